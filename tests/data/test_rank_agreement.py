"""Ranks agree or stop together (issue 38, items 1-4; DESIGN invariant 9): under sequence parallelism a rank
that holds another batch than rank 0 makes every rank raise, naming the field and the rank, before any
collective of the call ran.

One world of 2 gloo ranks (``python tests/data/test_rank_agreement.py OUTDIR 2``) runs every case in turn on
the same process group, rank 1 given something else than rank 0:

1. other pixels for the same images (``pixel_values + 0.5``, as per-process augmentation gives):
   ``stream_backward(vision=)`` on Qwen2-VL, and ``MultimodalGroupedBatch.model_inputs(shard=group)``;
2. a loss mask that scores one other token (the same count);
3. a loss mask with one token fewer (today: the log-prob all-reduce's sizes differ and gloo aborts both
   ranks with SIGABRT, so this case runs after the others);
4. another temperature;
plus another budget (a different schedule), and a rank that refuses its own arguments (the others raise
naming it instead of waiting in a collective). Oracle: each rank's error names the field and rank 1. Control:
the same call with equal arguments, before the mismatches and after all of them (the group still works:
nothing reached a mismatched collective), equals each sequence alone through the stock, unpatched model in
float64 (``test_stream_sequence_parallel._alone``, the independent oracle). Broken variant: fingerprints without
the loss masks let case 2 run silently, failing the same check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "patches"), str(TESTS / "stream"), str(TESTS.parent)]
from _gloo import NEEDS_GLOO, ranks_main, spawn  # noqa: E402
from conftest import precision  # noqa: E402
from test_stream_sequence_parallel import _error  # noqa: E402 -- "ExceptionType: message" of a call, or "no error"

pytestmark = NEEDS_GLOO

F64 = torch.float64
BUDGET = 128
TEMPERATURE = 0.7


def _shifted(vision: list, rank: int) -> list:
    """Rank 1's copy of ``vision`` (one dict or None per sequence / prompt): its pixels + 0.5."""
    if rank == 0:
        return vision
    return [None if v is None else {k: x + 0.5 if k == "pixel_values" else x for k, x in v.items()} for v in vision]


def _moved(masks: list, rank: int, drop: bool) -> list:
    """Rank 1's copy of ``masks``: sequence 0 scores its neighbour token instead of one (the same count; every
    collective keeps its size), or (``drop``) one token fewer."""
    if rank == 0:
        return masks
    out = [m.clone() for m in masks]
    m = out[0]
    if drop:  # its last scored token: no other sequence scores it, so a chunk produces one log-prob fewer
        m[int(torch.nonzero(m)[-1, 0])] = False
        return out
    i = int(torch.nonzero(m[:-1] & ~m[1:])[0, 0])   # a scored token followed by an unscored one
    m[i], m[i + 1] = False, True
    return out


# ------------------------------------------------------------------------------------------ worker side
def _without_loss_masks(fn) -> str:
    """Broken variant: ``fn`` run with fingerprints that leave the loss masks out."""
    from flexgroup.data.agreement import Fingerprint

    right = Fingerprint.of
    Fingerprint.of = classmethod(lambda cls, **f: right(**{k: v for k, v in f.items() if k != "loss_masks"}))
    try:
        return _error(fn)
    finally:
        Fingerprint.of = classmethod(right.__func__)


def _worker(rank: int, world: int, group, data) -> dict:
    import flexgroup
    from flexgroup.models.zoo import build_model
    from flexgroup.data.multimodal import MultimodalGroupedBatch
    from test_vl import make_vl

    seqs, masks = data["seqs"], data["masks"]
    loss = lambda lp, i: lp.sum()  # noqa: E731
    out = {}
    with precision(F64)[0]:
        llama = flexgroup.patch(build_model("llama", dtype=F64), sequence_parallel=group)
        control = lambda: flexgroup.stream_logprobs(llama, seqs, loss_masks=masks, budget=BUDGET,  # noqa: E731
                                                    temperature=TEMPERATURE)
        out["control"] = control()
        out["masks_same_count"] = _error(lambda: flexgroup.stream_backward(
            llama, seqs, loss, loss_masks=_moved(masks, rank, drop=False), budget=BUDGET))
        out["temperature"] = _error(lambda: flexgroup.stream_logprobs(
            llama, seqs, loss_masks=masks, budget=BUDGET, temperature=TEMPERATURE if rank == 0 else 0.8))

        vl = flexgroup.patch(make_vl("qwen2_vl", F64), sequence_parallel=group)
        vseqs, vision, vmasks, _ = data["vl_tree"]
        out["pixels_streamed"] = _error(lambda: flexgroup.stream_backward(
            vl, vseqs, loss, loss_masks=vmasks, budget=BUDGET, vision=_shifted(vision, rank)))
        prompts, responses, pvision, _ = data["vl_groups"]
        batch = MultimodalGroupedBatch.from_groups(prompts, responses, model=vl, vision=_shifted(pvision, rank))
        out["pixels_batch"] = _error(lambda: vl(**batch.model_inputs(shard=group)))

        out["broken"] = _without_loss_masks(lambda: flexgroup.stream_logprobs(
            llama, seqs, loss_masks=_moved(masks, rank, drop=False), budget=BUDGET))
        # mismatched sizes of collectives come last: today they abort every rank (gloo SIGABRT)
        out["mask_count"] = _error(lambda: flexgroup.stream_backward(
            llama, seqs, loss, loss_masks=_moved(masks, rank, drop=True), budget=BUDGET))
        out["budget"] = _error(lambda: flexgroup.stream_logprobs(
            llama, seqs, loss_masks=masks, budget=BUDGET if rank == 0 else 2 * BUDGET))
        # rank 1 refuses its own arguments (one loss mask too few): rank 0 raises, naming it, instead of waiting
        out["refused"] = _error(lambda: flexgroup.stream_logprobs(
            llama, seqs, loss_masks=masks if rank == 0 else masks[:-1], budget=BUDGET))
        out["control_after"] = control()
    return out


# ------------------------------------------------------------------------------------------ parent side
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from test_stream_sequence_parallel import _data
    from test_stream_vision import vl_tree
    from test_vl_sequence_parallel import _data as vl_groups

    data = dict(_data(), vl_tree=vl_tree("qwen2_vl"), vl_groups=vl_groups("qwen2_vl"))
    return spawn(__file__, 2, tmp_path_factory.mktemp("agree2"), data)


@pytest.mark.parametrize("case, field", [
    ("pixels_streamed", "visual"),          # item 1: streamed with vision=
    ("pixels_batch", "visual"),             # item 1: MultimodalGroupedBatch.model_inputs(shard=)
    ("masks_same_count", "loss_masks"),     # item 2
    ("mask_count", "loss_masks"),           # item 3 (today: SIGABRT on both ranks)
    ("temperature", "temperature"),         # item 4
    ("budget", "budget"),
])
def test_a_rank_holding_other_inputs_makes_every_rank_raise_naming_field_and_rank(two_ranks, case, field):
    for r in two_ranks[1:]:
        _assert_refused(r[case], field)


def _assert_refused(msg: str, field: str) -> None:
    assert msg.startswith("ValueError") and "disagree" in msg, msg
    assert f"field {field}" in msg or f"fields {field}" in msg or f", {field}" in msg, msg
    assert "rank 1 holds other" in msg, msg


def test_a_fingerprint_without_the_loss_masks_fails_the_same_check(two_ranks):
    for r in two_ranks[1:]:
        with pytest.raises(AssertionError, match="no error"):
            _assert_refused(r["broken"], "loss_masks")


def test_a_rank_that_refuses_its_own_arguments_makes_the_others_raise_naming_it(two_ranks):
    _, r0, r1 = two_ranks
    assert "rank 1 refused its own arguments" in r0["refused"], r0["refused"]
    assert "8 loss masks for 9 sequences" in r1["refused"], r1["refused"]   # its own error


def test_agreeing_ranks_still_run_exact_before_and_after_the_refusals(two_ranks):
    from test_stream_sequence_parallel import _alone

    data, r0, r1 = two_ranks
    ref, _, _ = _alone("llama", F64, data, TEMPERATURE)
    for r in (r0, r1):
        for key in ("control", "control_after"):
            assert (r[key] - ref).abs().max().item() <= 1e-10, key


def test_fingerprint_tells_apart_what_ranks_must_hold_equal():
    """In process: equal inputs give one fingerprint; a dtype, a shape, one bit of a float, a dict key differ."""
    from flexgroup.data.agreement import FIELDS, Fingerprint

    x = torch.arange(6, dtype=torch.float32)
    same = Fingerprint.of(input_ids=x.clone(), visual=[{"pixel_values": x}], temperature=0.7)
    assert same == Fingerprint.of(input_ids=x, visual=[{"pixel_values": x.clone()}], temperature=0.7)
    bit = x.clone()
    bit[3] = torch.nextafter(bit[3], torch.tensor(10.0))
    for other in (dict(input_ids=x.double()), dict(input_ids=x.view(2, 3)), dict(input_ids=bit),
                  dict(visual=[{"pixel_values_videos": x}]), dict(temperature=0.7000001)):
        fields = dict(input_ids=x, visual=[{"pixel_values": x}], temperature=0.7) | other
        fp = Fingerprint.of(**fields)
        changed = [f for f, a, b in zip(FIELDS, fp.digests, same.digests) if a != b]
        assert changed == list(other), (other, changed)
    with pytest.raises(TypeError, match="unknown fields"):
        Fingerprint.of(pixels=x)


if __name__ == "__main__":
    ranks_main(_worker)
