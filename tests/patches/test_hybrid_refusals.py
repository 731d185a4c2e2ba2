"""Hybrid architectures this transformers computes differently: refused at ``flexgroup.patch``, loudly.

Where the installed transformers computes a stateful mixer's state in a way flexgroup cannot fork
(transformers 4.56 and 5.10: the Mamba2 scans run inline in the mixers' torch forward; 5.10:
OLMo-hybrid's convolution modules), ``patch`` raises a TypeError naming the transformers version, the
architecture and the fix (upgrade), and leaves the model unpatched; the exactness tests
(``test_hybrids.py``, ``test_stream_hybrids.py``) skip exactly those (``zoo.unforked``). Not skipped
as a module on transformers without Qwen3.5, so the refusals are also checked on the oldest supported.
"""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup.bench.zoo import build_model, unforked
from flexgroup.patches import hybrid
from flexgroup.patches._common import find_language_model, unwrap

ARCHS = ["qwen3_5_text", "qwen3_next", "olmo_hybrid", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1"]


def _mixers(model):
    return hybrid.stateful_modules(find_language_model(unwrap(model), "model"))


# what GraniteMoeHybrid / NemotronH checkpoints configure where the config does not take the zoo's layer types
OLD_VOCABULARY = {"granitemoehybrid": dict(layer_types=None, layers_block_type=["mamba", "attention"]),
                  "nemotron_h": dict(layers_block_type=["mamba", "mlp", "attention", "mlp"])}


@pytest.mark.parametrize("arch", ARCHS)
def test_refusals_name_the_version_and_the_fix(arch):
    """Where this transformers computes a mixer's state in a way flexgroup cannot fork (transformers 5.10:
    the Mamba2 scans inline, OLMo-hybrid's conv modules), ``patch`` refuses with a TypeError naming the
    version, the architecture and the upgrade, and leaves the model unpatched; elsewhere it patches."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if arch not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model type {arch!r}")
    model = None
    for overrides in ({}, OLD_VOCABULARY.get(arch, {})):  # the zoo's layer types, then transformers 5.10's names
        try:
            model = build_model(arch, dtype=torch.float64, **overrides)
        except Exception:  # noqa: BLE001,S112 -- a config vocabulary of another transformers generation
            continue
        if _mixers(model):
            break
    if model is None or not _mixers(model):
        pytest.skip(f"transformers {transformers.__version__} builds the tiny {arch} without a stateful layer")
    try:
        flexgroup.patch(model)
    except TypeError as e:
        msg = str(e)
        assert transformers.__version__ in msg and arch in msg and "Upgrade transformers" in msg, msg
        assert not flexgroup.patches.is_patched(model)
        assert unforked(arch) is not None  # the other tests skip it
    else:
        assert flexgroup.patches.is_patched(model) and unforked(arch) is None


def test_a_mixer_call_that_bypasses_the_forked_kernels_is_caught(monkeypatch):
    """Broken variant: the forked kernels run but do not report it (as if the stock forward had taken a
    path flexgroup does not wrap): the grouped mixer call raises instead of returning leaked state."""
    from flexgroup import GroupedBatch

    if why := unforked("qwen3_5_text"):
        pytest.skip(why)
    model = flexgroup.patch(build_model("qwen3_5_text", dtype=torch.float64))
    batch = GroupedBatch.from_groups([torch.tensor([1, 2, 3])], [[torch.tensor([4]), torch.tensor([5, 6])]])
    model(**batch.model_inputs())  # the real wrappers report both kernels
    monkeypatch.setattr(hybrid._Fork, "hit", lambda self, kernel: None)
    with pytest.raises(RuntimeError, match="did not run flexgroup's forked"):
        model(**batch.model_inputs())


def test_sequence_parallel_refuses_mixers_it_cannot_shard():
    """transformers 5.10's Gated DeltaNet holds its kernels as instance attributes: flexgroup forks them but
    does not all-to-all them, so ``patch(sequence_parallel=)`` refuses (a one-rank gloo group) and leaves
    the model unpatched."""
    import copy
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    if why := unforked("qwen3_5_text"):
        pytest.skip(why)
    model = build_model("qwen3_5_text", dtype=torch.float64)
    probe = flexgroup.patch(copy.deepcopy(model))
    if not any("_flexgroup_saved_attrs" in m.__dict__ for _, _, m in _mixers(probe)):
        pytest.skip("this transformers' Gated DeltaNet calls module-level kernels, which flexgroup shards")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        with pytest.raises(TypeError, match="Upgrade transformers"):
            flexgroup.patch(model, sequence_parallel=dist.group.WORLD)
        assert not flexgroup.patches.is_patched(model)
    finally:
        dist.destroy_process_group()
