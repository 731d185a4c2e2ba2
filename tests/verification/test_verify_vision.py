"""flexgroup.verify on vision-language batches: the per-sequence baseline runs each sequence with its own
images / videos, grids, timing and token types (``batch.sequence_inputs(i)``), so an exact
``MultimodalGroupedBatch`` is reported equivalent and a leaky one is not.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from flexgroup.verification.equivalence import verify
from flexgroup.data.multimodal import MultimodalGroupedBatch

from test_vl import IMG, case, make_vl  # the tiny Qwen-VL builders of tests/patches/test_vl.py


def _groups_batch(kind):
    model = make_vl(kind)
    prompts, responses, vision = case("mixed_groups", kind)
    return model, MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)


def _tree_batch(kind):
    """Trajectories with a screenshot in a later turn, a strict prefix among them."""
    model = make_vl(kind)
    prompts, _, vision = case("image", kind)
    (p,), (v,) = prompts, vision
    g = torch.Generator().manual_seed(5)
    shot = torch.randn(16, v["pixel_values"].shape[1], generator=g)
    turn = torch.cat([torch.randint(3, 100, (3,), generator=g), torch.tensor([122] + [IMG] * 4 + [123])])
    tail = torch.randint(3, 100, (4,), generator=g)
    later = dict(pixel_values=torch.cat([v["pixel_values"], shot]),
                 image_grid_thw=torch.cat([v["image_grid_thw"], torch.tensor([[1, 4, 4]])]))
    seqs = [torch.cat([p, turn, tail]), torch.cat([p, turn, tail[:2]]), torch.cat([p, tail])]
    batch = MultimodalGroupedBatch.from_sequences(seqs, model=model, vision=[later, later, v])
    return model, batch


@pytest.mark.parametrize("build,kind", [(_groups_batch, "qwen2_vl"), (_groups_batch, "qwen2_5_vl"),
                                        (_tree_batch, "qwen3_vl")],
                         ids=["groups_qwen2_vl", "groups_qwen2_5_vl", "tree_qwen3_vl"])
def test_verify_says_yes_on_an_exact_vision_language_batch(build, kind):
    model, batch = build(kind)
    report = verify(model, batch)
    assert report.ok, report.table()
    assert report["logits"].max_abs < 1e-4
    assert report.baseline_tokens == sum(len(p) for p in batch.paths)


def test_verify_says_no_on_a_leaky_vision_language_batch(causal_over_packed_row):
    model, batch = _groups_batch("qwen2_5_vl")
    report = verify(model, batch)
    assert not report.ok and report["logits"].max_abs > 1e-2


def test_each_sequences_own_visual_inputs_reach_the_baseline():
    model, batch = _tree_batch("qwen3_vl")
    shots = [batch.sequence_inputs(i)["image_grid_thw"].shape[0] for i in range(batch.num_responses)]
    assert shots == [2, 2, 1]
    types = batch.sequence_inputs(0)["mm_token_type_ids"]
    assert types.shape == (1, len(batch.paths[0])) and int(types.sum()) == int((batch.input_ids[batch.paths[0]] == IMG).sum())


def test_where_the_rope_index_takes_no_token_types_the_baseline_gets_an_all_ones_mask():
    # transformers 4.x: without a mask the stock model takes a sequence with images for a packed one and
    # splits it at every image, so verify's baseline itself would be wrong (it reported "no", logits 0.4 off)
    model, batch = _groups_batch("qwen2_5_vl")
    extra = batch.sequence_inputs(1)
    if "mm_token_type_ids" in inspect.signature(batch.rope.rope_index).parameters:
        assert "attention_mask" not in extra and extra["mm_token_type_ids"].shape == (1, len(batch.paths[1]))
    else:
        assert torch.equal(extra["attention_mask"], torch.ones(1, len(batch.paths[1]), dtype=torch.long))


def test_rows_given_out_of_group_order_keep_their_own_visual_inputs():
    model = make_vl("qwen2_vl")
    prompts, responses, vision = case("two_groups", "qwen2_vl")
    rows = [(0, responses[0][0]), (1, responses[1][0]), (0, responses[0][1]), (1, responses[1][1])]  # interleaved
    lp_, lc = max(len(p) for p in prompts), max(len(r) for _, r in rows)
    pid, pm = torch.zeros(len(rows), lp_, dtype=torch.long), torch.zeros(len(rows), lp_, dtype=torch.long)
    cid, cm = torch.zeros(len(rows), lc, dtype=torch.long), torch.zeros(len(rows), lc, dtype=torch.long)
    for i, (g, r) in enumerate(rows):
        pid[i, lp_ - len(prompts[g]):], pm[i, lp_ - len(prompts[g]):] = prompts[g], 1
        cid[i, :len(r)], cm[i, :len(r)] = r, 1
    mm = {k: torch.cat([vision[g][k] for g, _ in rows]) for k in vision[0]}
    batch = MultimodalGroupedBatch.from_padded(pid, pm, cid, cm, group_ids=[g for g, _ in rows], model=model, **mm)
    for i, (g, _) in enumerate(rows):
        assert torch.equal(batch.sequence_inputs(i)["pixel_values"], vision[g]["pixel_values"])


def test_the_spread_calibration_is_not_measured_without_the_images():
    # its padded batch carries no pixel values: a floor of 0.1 in log-probs and inf in gradients, under
    # which anything would pass; verify drops it and says why
    model, batch = _groups_batch("qwen2_5_vl")
    report = verify(model, batch, calibration="spread")
    assert report.calibration == "none" and "carries no images" in report.table()
    assert report.ok and all(d.calibrated is None for d in report.differences)
