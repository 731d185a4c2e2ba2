"""Which hybrids ``flexgroup.patch`` forks, decided by behaviour, and how it refuses the rest.

Support is declared per architecture (``HybridArchSpec.forks_since``, the oldest transformers the suite
ran it on). On that release and later every hybrid must patch: a refusal there fails here (and the
exactness tests, ``test_hybrids.py`` / ``test_stream_hybrids.py``, run rather than skip). Below it a
refusal must name the installed version, the architecture and the release that works.

The decision is a probe at ``patch`` time (one grouped call of each mixer class on a tiny row, checked
against each sequence alone), so each broken variant below simulates a transformers change without
editing transformers' source: a mixer that stops calling the forked kernels, a fork that leaks state
(the probe's numeric check), a kernel swapped by ``kernels.kernelize``, and a mixer whose forward is
replaced after ``patch`` (the model-level guard).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.models.zoo import build_model, unavailable
from flexgroup.patches import HYBRIDS, hybrid
from flexgroup.patches.hybrid import attrs as hybrid_attrs
from flexgroup.patches.hybrid import wrappers as hybrid_wrappers
from flexgroup.patches._common import find_language_model, unwrap

ARCHS = ["qwen3_5_text", "qwen3_next", "olmo_hybrid", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1"]


def _mixers(model):
    return [m for _, _, m in hybrid.stateful_modules(find_language_model(unwrap(model), "model"))]


# what GraniteMoeHybrid / NemotronH checkpoints configure where the config does not take the zoo's layer types
OLD_VOCABULARY = {"granitemoehybrid": dict(layer_types=None, layers_block_type=["mamba", "attention"]),
                  "nemotron_h": dict(layers_block_type=["mamba", "mlp", "attention", "mlp"])}


@pytest.mark.parametrize("arch", ARCHS)
def test_declared_hybrids_patch_and_older_releases_are_refused_truthfully(arch):
    """At or above ``forks_since`` the tiny model patches (anything else fails the suite). Below it, where
    transformers builds the model with a stateful layer, ``patch`` either forks it or refuses with a
    TypeError naming the installed transformers, the architecture and ``transformers>=forks_since``, and
    leaves the model unpatched."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    why = unavailable(arch)
    if why is None:  # declared supported here: it must build with stateful layers and patch
        model = build_model(arch, dtype=torch.float64)
        assert _mixers(model), f"transformers {transformers.__version__} built the tiny {arch} without a mixer"
        flexgroup.patch(model)
        assert flexgroup.patches.is_patched(model)
        return
    if arch not in CONFIG_MAPPING:
        pytest.skip(why)
    model = None
    for overrides in ({}, OLD_VOCABULARY.get(arch, {})):  # the zoo's layer types, then older releases' names
        try:
            model = build_model(arch, dtype=torch.float64, **overrides)
        except Exception:  # noqa: BLE001,S112 -- a config vocabulary of another transformers generation
            continue
        if _mixers(model):
            break
    if model is None or not _mixers(model):
        pytest.skip(f"{why}; it builds the tiny {arch} without a stateful layer")
    try:
        flexgroup.patch(model)
    except TypeError as e:
        msg = str(e)
        since = HYBRIDS[arch].forks_since
        assert transformers.__version__ in msg and arch in msg and f"transformers>={since}" in msg, msg
        assert not flexgroup.patches.is_patched(model)
    else:
        assert flexgroup.patches.is_patched(model)


def _supported(arch="qwen3_5_text"):
    if why := unavailable(arch):
        pytest.skip(why)
    return build_model(arch, dtype=torch.float64)


def test_a_mixer_that_stops_calling_the_forked_kernels_is_refused(monkeypatch):
    """Broken variant (a transformers release that computes the state on another code path): the mixer's
    forward runs its kernels outside flexgroup's fork. The patch-time probe refuses, naming the installed
    versions and what the mixer did, and -- since the release is one flexgroup declares -- asks for a
    report instead of an upgrade to what is installed."""
    import transformers

    model = _supported()
    cls = type(_mixers(model)[0])
    stock = cls.forward

    def another_code_path(self, *args, **kwargs):
        token = hybrid_wrappers.ACTIVE.set(None)
        try:
            return stock(self, *args, **kwargs)
        finally:
            hybrid_wrappers.ACTIVE.reset(token)

    monkeypatch.setattr(cls, "forward", another_code_path)
    with pytest.raises(TypeError) as e:
        flexgroup.patch(model)
    msg = str(e.value)
    assert transformers.__version__ in msg and torch.__version__ in msg and cls.__name__ in msg, msg
    assert "forked conv ran: False, forked scan ran: False" in msg and "please report it" in msg, msg
    assert "pip install -U" not in msg, msg
    assert not flexgroup.patches.is_patched(model)


def test_a_fork_that_leaks_state_is_refused_by_the_probe(monkeypatch):
    """Broken variant for the probe's numeric check: the forked conv reports that it ran but convolves the
    whole packed row (the conv window of each response reads the previous response). Every kernel ran, so
    only the comparison with each sequence alone can catch it: ``patch`` refuses, naming the error."""
    model = _supported()

    def leaking_conv(original, plan, x, weight, bias=None, activation=None, conv_input=None, **kwargs):
        return original(x, weight, bias, activation=activation, **kwargs)

    monkeypatch.setattr(hybrid_wrappers, "forked_conv", leaking_conv)
    monkeypatch.setattr(hybrid_attrs, "forked_conv", leaking_conv)  # transformers 5.10's instance kernels
    with pytest.raises(TypeError, match="differs from each sequence run alone by"):
        flexgroup.patch(model)
    assert not flexgroup.patches.is_patched(model)


def test_a_kernelized_conv_that_bypasses_the_fork_is_refused_naming_kernelize():
    """``kernels.kernelize`` swaps a declared function (``@use_kernelized_func``) on a layer for a Hub kernel.
    Simulated without the Hub: the layer's ``causal_conv1d_forward`` is replaced the way kernelize does it
    (an instance ``forward`` and a ``_kernel_repo``) by a kernel that convolves on its own. ``patch``
    refuses and names kernelize."""
    import transformers

    model = _supported()
    mixer = _mixers(model)[0]
    funcs = mixer.__dict__.get("_kernel_funcs", {})
    if "causal_conv1d_forward" not in funcs:
        pytest.skip(f"transformers {transformers.__version__}'s {type(mixer).__name__} declares no kernelized "
                    "causal_conv1d_forward (transformers 5.25 and later do)")

    def hub_kernel(self, conv1d, x, cache, layer_idx, activation=None, **kwargs):
        out = torch.nn.functional.conv1d(x, conv1d.weight, conv1d.bias, padding=conv1d.kernel_size[0] - 1,
                                         groups=x.shape[1])[..., : x.shape[-1]]
        return torch.nn.functional.silu(out)

    for m in _mixers(model):
        kf = m._kernel_funcs["causal_conv1d_forward"]
        kf.forward = types.MethodType(hub_kernel, kf)
        kf.__dict__["_kernel_repo"] = "a Hub kernel"
    with pytest.raises(TypeError, match=r"kernelize replaced \['causal_conv1d_forward'\]"):
        flexgroup.patch(model)


def test_a_mixer_forward_replaced_after_patch_is_taken_back_before_a_grouped_forward():
    """``kernelize`` after ``patch`` (transformers re-kernelizes a loaded model on every ``train()`` / ``eval()``)
    replaces each mixer's forward: with the class's (kernels' fallback deletes the instance forward) or with a
    Hub layer that ignores the mask (simulated: it would run over the packed row and leak state). The next
    grouped forward takes flexgroup's forward back (after the probe) and gives the same numbers; ungrouped
    forwards run the replacement."""
    model = flexgroup.patch(_supported())
    batch = GroupedBatch.from_groups([torch.tensor([1, 2, 3, 4])], [[torch.tensor([5, 6]), torch.tensor([7])]])
    calls = []

    def hub_layer(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        calls.append(id(self))
        return type(self).forward(self, hidden_states)

    with torch.no_grad():
        before = model(**batch.model_inputs()).logits
        for m in _mixers(model):
            del m.forward  # what kernels' _replace_forward does when it falls back to the class's forward
        assert torch.equal(model(**batch.model_inputs()).logits, before)
        for m in _mixers(model):
            m.forward = types.MethodType(hub_layer, m)
        assert torch.equal(model(**batch.model_inputs()).logits, before)  # (the probe ran the Hub layer alone)
        n = len(calls)
        model(input_ids=torch.tensor([[1, 2, 3]]))
        assert len(calls) == n + len(_mixers(model))


def test_a_mixer_reached_without_the_grouped_mask_is_caught_by_the_model_guard():
    """A decoder layer that hands its mixer no grouped mask (simulated by a pre-hook that drops it) makes the
    mixer run its stock forward over the packed row: the language model's forward hook raises at its end."""
    model = flexgroup.patch(_supported())
    batch = GroupedBatch.from_groups([torch.tensor([1, 2, 3, 4])], [[torch.tensor([5, 6]), torch.tensor([7])]])

    def drop_mask(module, args, kwargs):
        return args, {**kwargs, "attention_mask": None}

    for m in _mixers(model):
        m.register_forward_pre_hook(drop_mask, with_kwargs=True)
    with torch.no_grad(), pytest.raises(RuntimeError, match="did not take flexgroup's grouped path"):
        model(**batch.model_inputs())


def test_unpatch_gives_back_an_instance_forward_the_mixer_had():
    """A mixer that carried an instance forward before ``patch`` (``kernelize`` sets one) runs it again for
    ungrouped calls while patched, and has it back after ``unpatch``."""
    model = _supported()
    calls = []
    for m in _mixers(model):
        stock = type(m).forward

        def mine(self, *args, **kwargs):
            calls.append(id(self))
            return stock(self, *args, **kwargs)

        m.forward = types.MethodType(mine, m)
    flexgroup.patch(model)
    assert calls   # the patch-time probe checked the grouped path against that forward, run on each sequence alone
    calls.clear()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert len(calls) == len(_mixers(model))
    flexgroup.unpatch(model)
    assert all(m.forward.__func__.__name__ == "mine" for m in _mixers(model))


def test_a_mixer_call_that_bypasses_the_forked_kernels_is_caught(monkeypatch):
    """Broken variant at run time: the forked kernels run but do not report it (as if the stock forward had
    taken a path flexgroup does not wrap): the grouped mixer call raises instead of returning leaked state."""
    model = flexgroup.patch(_supported())
    batch = GroupedBatch.from_groups([torch.tensor([1, 2, 3])], [[torch.tensor([4]), torch.tensor([5, 6])]])
    model(**batch.model_inputs())  # the real wrappers report both kernels
    monkeypatch.setattr(hybrid_wrappers.Fork, "hit", lambda self, kernel: None)
    with pytest.raises(RuntimeError, match="did not run flexgroup's forked"):
        model(**batch.model_inputs())


def test_the_wrapped_kernels_are_the_modeling_modules_own():
    """The wrappers sit on the mixer's modeling module (one set per module, pass-through when idle), and
    ``patch`` of a second model reuses them (transformers 5.10: on each mixer instance instead)."""
    model = flexgroup.patch(_supported())
    mixer = _mixers(model)[0]
    if hybrid_wrappers.holds_kernels(mixer, hybrid.GDN):
        assert all("_flexgroup_saved_attrs" in m.__dict__ for m in _mixers(model))
        return
    module = sys.modules[type(mixer).__module__]
    fns = {n: getattr(module, n) for n in hybrid_wrappers.FUNCTIONS[hybrid.GDN]}
    assert all(getattr(f, "_flexgroup_original", None) is not None for f in fns.values())
    flexgroup.patch(_supported())
    assert all(getattr(module, n) is f for n, f in fns.items())


def test_sequence_parallel_refuses_mixers_it_cannot_shard():
    """transformers 5.10's Gated DeltaNet holds its kernels as instance attributes: flexgroup forks them but
    does not all-to-all them, so ``patch(sequence_parallel=)`` refuses (a one-rank gloo group) and leaves
    the model unpatched."""
    import copy
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    model = _supported()
    probe = flexgroup.patch(copy.deepcopy(model))
    if not any("_flexgroup_saved_attrs" in m.__dict__ for m in _mixers(probe)):
        pytest.skip("this transformers' Gated DeltaNet calls module-level kernels, which flexgroup shards "
                    "(the refusal concerns transformers 5.10's instance-attribute kernels)")
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


def _two_mixers():
    """The tiny Qwen3.5 with two Gated DeltaNet layers (same class) and two attention layers."""
    if why := unavailable("qwen3_5_text"):
        pytest.skip(why)
    model = build_model("qwen3_5_text", dtype=torch.float64, num_hidden_layers=4,
                        layer_types=["linear_attention", "full_attention"] * 2)
    assert len(_mixers(model)) == 2
    return model


def _scaled(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """A replacement forward that is not the mixer's (its output times 1.5)."""
    return type(self).forward(self, hidden_states, **kwargs) * 1.5


def _same(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    return type(self).forward(self, hidden_states, **kwargs)


@pytest.mark.parametrize("when", ["before_patch", "after_patch"])
def test_one_layers_own_replacement_forward_is_probed_not_only_the_first_of_its_class(when):
    """The second mixer alone runs another forward (the first: a faithful replacement, or none): the grouped path
    (the class's forward, forked) would silently differ from what the model runs ungrouped -- before, by 0.41 in
    a log-prob, since only the first mixer of a class was probed. Now that mixer is probed and refused."""
    model = _two_mixers()
    first, second = _mixers(model)
    batch = GroupedBatch.from_groups([torch.tensor([1, 2, 3, 4])], [[torch.tensor([5, 6]), torch.tensor([7])]])
    if when == "after_patch":
        flexgroup.patch(model)
        first.forward = types.MethodType(_same, first)
    second.forward = types.MethodType(_scaled, second)
    with torch.no_grad(), pytest.raises(TypeError, match="Qwen3_5GatedDeltaNet: its grouped output differs"):
        flexgroup.patch(model) if when == "before_patch" else model(**batch.model_inputs())
