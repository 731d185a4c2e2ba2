"""Streaming x vision-language x sequence parallelism: ``stream_backward(..., vision=...)`` on a Qwen-VL model
patched with ``sequence_parallel=group``, every chunk sharded over 2 gloo ranks.

The ranks run in a fresh interpreter (``python tests/stream/test_stream_vision_sequence_parallel.py OUTDIR 2``).
Each streams :func:`test_stream_vision.vl_tree` (images per turn, a mid-turn branch, an image cut across
chunks, a video, text only) under a budget of 128 tokens; the workers all-reduce (sum) every parameter
gradient -- the vision tower's included: every rank encodes every item and its leaves collect the gradient of
its own tokens -- and the parent compares them and the log-probs with each sequence alone through the stock,
unpatched model (:func:`test_stream_vision.alone`), float64 and float32 (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; the
Qwen3.5 Gated DeltaNet hybrid in float64). Broken variant: the tower's leaf
gradients all-reduced before its backward (every rank then back-propagates the whole gradient: the tower's
parameters counted twice) must fail the comparison.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "patches"), str(TESTS / "stream"), str(TESTS.parent)]
from _gloo import NEEDS_GLOO, one_rank_group, ranks_main, spawn  # noqa: E402
from conftest import precision  # noqa: E402
from test_stream_sequence_parallel import _summed  # noqa: E402 -- a gradient all-reduced (summed) over the group

pytestmark = NEEDS_GLOO

F64, F32 = torch.float64, torch.float32
BUDGET = 128
CASES = {"qwen2_vl-f64": ("qwen2_vl", F64), "qwen2_5_vl-f64": ("qwen2_5_vl", F64), "qwen3_vl-f64": ("qwen3_vl", F64),
         "qwen3_vl-f32": ("qwen3_vl", F32), "qwen3_5-f64": ("qwen3_5", F64)}   # qwen3_5: Gated DeltaNet hybrid VL


def _available(kind) -> bool:
    import transformers

    return hasattr(transformers, {"qwen2_vl": "Qwen2VLConfig", "qwen2_5_vl": "Qwen2_5_VLConfig",
                                  "qwen3_vl": "Qwen3VLConfig", "qwen3_5": "Qwen3_5Config"}[kind])


def _make(kind, dtype):
    if kind == "qwen3_5":
        from test_hybrids import _qwen3_5_vl

        return _qwen3_5_vl(dtype)
    from test_vl import make_vl

    return make_vl(kind, dtype)


def _tree(kind, data):
    return data["qwen3_vl" if kind == "qwen3_5" else kind]   # Qwen3.5 takes Qwen3-VL's prompts


# ------------------------------------------------------------------------------------------ worker side
def _case(name, group, data):
    import flexgroup

    kind, dtype = CASES[name]
    if not _available(kind):
        return {"skipped": f"{kind} is not in this transformers"}
    seqs, vision, masks, adv = _tree(kind, data)
    with precision(dtype)[0]:
        model = flexgroup.patch(_make(kind, dtype), sequence_parallel=group)
        res = flexgroup.stream_backward(model, seqs, lambda lp, i: (lp * adv[i, None].to(lp.dtype)).sum(),
                                        loss_masks=masks, budget=BUDGET, vision=vision)
    return {"lp": res.logprobs, "loss": res.loss, "forwards": res.forwards,
            "grads": {n: _summed(p.grad, group) for n, p in model.named_parameters() if p.grad is not None}}


def _tower_counted_twice(group, data):
    from flexgroup.stream.vision import StreamVision

    right = StreamVision.backward

    def summed(self):
        for leaf in self.leaves:
            if leaf.grad is not None:
                dist.all_reduce(leaf.grad, group=group)
        right(self)

    StreamVision.backward = summed
    try:
        return _case("qwen2_vl-f64", group, data)
    finally:
        StreamVision.backward = right


def _worker(rank: int, world: int, group, data) -> dict:
    out = {name: _case(name, group, data) for name in CASES}
    out["broken"] = _tower_counted_twice(group, data)
    return out


# ------------------------------------------------------------------------------------------ parent side
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from test_stream_vision import vl_tree

    data = {kind: vl_tree(kind) for kind in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")}
    return spawn(__file__, 2, tmp_path_factory.mktemp("svsp2"), data)


_ORACLE: dict = {}


def _alone(kind, dtype, data):
    if (kind, dtype) not in _ORACLE:
        from test_stream_vision import alone, grads

        with precision(dtype)[0]:
            stock = _make(kind, dtype)
            lp = alone(stock, *_tree(kind, data), dtype)
        _ORACLE[(kind, dtype)] = (lp, grads(stock))
    return _ORACLE[(kind, dtype)]


def _check(name, data, got, other=None):
    from test_stream_vision import compare

    if "skipped" in got:
        pytest.skip(got["skipped"])
    kind, dtype = CASES[name]
    ref, want = _alone(kind, dtype, data)
    assert got["forwards"] >= 4
    assert any(n.startswith("model.visual.") for n in want)
    compare(got["lp"], got["grads"], ref, want, dtype)
    if other is not None:  # every rank holds the whole log-probs and the same loss
        assert torch.equal(other["lp"], got["lp"]) and other["loss"] == got["loss"]


@pytest.mark.parametrize("name", list(CASES))
def test_vl_tree_streamed_on_two_ranks_equals_each_sequence_alone(two_ranks, name):
    data, r0, r1 = two_ranks
    _check(name, data, r0[name], r1[name])


def test_tower_gradient_counted_on_every_rank_is_caught(two_ranks):
    data, r0, _ = two_ranks
    with pytest.raises(AssertionError, match="model.visual.*grad error"):
        _check("qwen2_vl-f64", data, r0["broken"])


def test_one_rank_group_streams_vision_as_without_the_group(monkeypatch):
    import flexgroup
    from flexgroup.stream import vision as stream_vision
    from test_stream_vision import vl_tree
    from test_vl import make_vl

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    seqs, vision, masks, _ = vl_tree("qwen2_vl")
    with one_rank_group() as group:
        model = flexgroup.patch(make_vl("qwen2_vl"), sequence_parallel=group)
        a = flexgroup.stream_logprobs(model, seqs, loss_masks=masks, budget=BUDGET, vision=vision)
        b = flexgroup.stream_logprobs(model, seqs, loss_masks=masks, budget=BUDGET, vision=vision,
                                      sequence_parallel=False)
        torch.testing.assert_close(a, b, rtol=0, atol=5e-6)
        monkeypatch.setattr(stream_vision, "SUPPORTED", ("qwen2_5_vl", "qwen3_vl"))   # a model type not handled
        short = [s[s < 100][:20] for s in seqs]                                     # text only, trees that fit
        with pytest.raises(NotImplementedError, match="streaming with sequence parallelism on the vision-language "
                                                      "model qwen2_vl is not supported"):
            flexgroup.stream_logprobs(model, short, budget=BUDGET)


if __name__ == "__main__":
    ranks_main(_worker)
