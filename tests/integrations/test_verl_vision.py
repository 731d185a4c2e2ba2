"""flexgroup's verl engine on Qwen2.5-VL batches against verl's STOCK engine (verl 0.9), on CPU.

The oracle is verl itself: ``FSDPEngineWithLMHead`` built from the same tiny Qwen2.5-VL (and, one case,
Qwen3-VL) checkpoint, fed
the same agent-loop batch (one image per prompt, ``multi_modal_inputs`` per sample, ``position_ids``
``[N, 4, L]`` from the model's own ``get_rope_index``), through verl's ``forward_backward_batch`` and
``ppo_loss`` (entropy bonus and KL loss on) or its forward-only pass (old-log-prob / reference). Compared:
every log-prob and entropy value, the losses, every parameter gradient of decoder AND vision tower; float64
(norms kept in float64) to 1e-12, float32 within 5x the stock engine's own float32 noise (its distance to
its float64 run); one gloo rank and FSDP2 over two. Counted by forward hooks: patch rows entering the
vision tower, each distinct image once per forward instead of once per response. A broken variant (M-RoPE
dropped) must fail; ids that are not the model's own fall back to verl's step, bit-identical, one warning.

Skipped, with the reason, where verl is not installed (the main suite's environment).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("verl", minversion="0.9", reason="verl 0.9 is not installed (pip install 'flexgroup[verl]')")

from test_verl import (_assert_same_grads, _assert_same_metrics, _assert_same_outputs,  # noqa: E402
                       ranks, run_harness)  # noqa: F401  -- ranks: test_verl's per-world fixture over this harness

HARNESS = Path(__file__).with_name("_verl_vision_harness.py")
TRAIN = [f"vl-train-{dtype}-{pad}" for dtype in ("fp64", "fp32") for pad in ("rmpad", "padded")] + [
    "vl3-train-fp64-rmpad"]  # Qwen3-VL (deepstack visual features in the first decoder layers)
PLANNED = ["vl-half-groups-fp64", "vl-dynamic-bsz-fp32"]
FORWARD_ONLY = ["vl-old-log-prob-fp32", "vl-ref-log-prob-fp64"]
DISTINCT_PATCHES = {0: 16 + 16 + 32, 1: 16 + 16 + 16}  # per rank: its three prompts' images (patch rows)


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> dict[int, list[dict]]:
    return run_harness(HARNESS, tmp_path_factory, "verl_vision")


def _same_grads(got: dict, ref: dict, rel: float, what: str) -> None:
    """test_verl's gradient comparison; a parameter whose stock gradient is exactly zero (the tiny Qwen3-VL's
    last deepstack merger norm) must be exactly zero here too."""
    zero = [n for n, g in ref.items() if not bool(g.abs().max() > 0)]
    for n in zero:
        assert n in got and not bool(got[n].abs().max() > 0), f"{what}: {n} has a nonzero gradient"
    _assert_same_grads({n: g for n, g in got.items() if n not in zero},
                       {n: g for n, g in ref.items() if n not in zero}, rel, what)


def _noise(res: dict, case: str) -> tuple[float, float]:
    """The stock engine's own float32 noise on ``case``'s batch: (log-prob abs, gradient rel to max) between
    its float32 and float64 runs of the same batch."""
    s32, s64 = res[case]["stock"], res[case.replace("fp32", "fp64")]["stock"]
    lp = (s32["log_probs"].double() - s64["log_probs"]).abs().max().item()
    grad = max(((s32["grads"][n].double() - g).abs().max() / g.abs().max()).item() for n, g in s64["grads"].items())
    return lp, grad


def _tolerances(res: dict, case: str) -> tuple[float, float]:
    if "fp64" in case:
        return 1e-12, 1e-10
    lp, grad = _noise(res, "vl-train-fp32-padded")  # the same rows in every case: one noise floor
    assert lp > 0 and grad > 0, "the float32 stock run equals the float64 one: no noise floor to compare with"
    return 5 * lp, 5 * grad


@pytest.mark.parametrize("case", TRAIN + PLANNED)
def test_vl_outputs_losses_and_every_gradient_equal_verls_stock_engine(ranks, case):
    for r, res in enumerate(ranks):
        got, ref = res[case]["flexgroup"], res[case]["stock"]
        atol, rel = _tolerances(res, case)
        assert len(ref["grads"]) == ref["n_params"] and any(".visual." in n for n in ref["grads"])  # every one
        _assert_same_outputs(got, ref, atol, f"{case} rank {r}")
        _assert_same_metrics(got, ref, max(atol, 1e-6), f"{case} rank {r}")
        _same_grads(got["grads"], ref["grads"], rel, f"{case} rank {r}")
        assert got["warnings"] == [] or case in PLANNED, got["warnings"]
        assert got["stats"]["fallback_micro_batches"] == 0


@pytest.mark.parametrize("case", FORWARD_ONLY)
def test_vl_old_log_prob_and_reference_passes_equal_verls_stock_engine(ranks, case):
    for r, res in enumerate(ranks):
        got, ref = res[case]["flexgroup"], res[case]["stock"]
        _assert_same_outputs(got, ref, _tolerances(res, case)[0], f"{case} rank {r}")
        assert got["stats"]["fallback_micro_batches"] == 0


@pytest.mark.parametrize("case", TRAIN + FORWARD_ONLY + PLANNED)
def test_each_image_is_encoded_once_per_forward(ranks, case):
    """Forward-hook counts: verl's step encodes each sample's copy (4 responses per image); flexgroup's each
    distinct image once per forward -- once in all when no forward splits a group."""
    for r, res in enumerate(ranks):
        got, ref = res[case]["flexgroup"], res[case]["stock"]
        distinct = DISTINCT_PATCHES[r]
        assert ref["tower_patches"] == 4 * distinct
        assert got["stats"]["vision_patches"] == ref["tower_patches"]           # the engine's stock count is true
        assert got["stats"]["grouped_vision_patches"] == got["tower_patches"]   # and its grouped count
        assert distinct <= got["tower_patches"] < ref["tower_patches"]
        if got["stats"]["forwards"] == 1 or case in FORWARD_ONLY or case.endswith("rmpad"):
            assert got["tower_patches"] == distinct, f"{case} rank {r}: an image was encoded more than once"
        assert got["stats"]["grouped_tokens"] < got["stats"]["real_tokens"]


def test_broken_variant_without_mrope_is_caught(ranks):
    """The grouped forward given 1-D positions on all rows (M-RoPE dropped) must fail the comparison."""
    for res in ranks:
        got, ref = res["vl-train-fp32-rmpad"]["broken"], res["vl-train-fp32-rmpad"]["stock"]
        atol, rel = _tolerances(res, "vl-train-fp32-rmpad")
        with pytest.raises(AssertionError, match="differs"):
            _assert_same_outputs(got, ref, atol, "broken")
        with pytest.raises(AssertionError, match="differs"):
            _same_grads(got["grads"], ref["grads"], rel, "broken")


def test_foreign_position_ids_fall_back_bit_identical_with_one_warning(ranks):
    """M-RoPE ids that are not the model's own index: verl's stock step on verl's micro-batches, bit-identical."""
    for res in ranks:
        got, ref = res["vl-foreign-positions-fp32"]["flexgroup"], res["vl-foreign-positions-fp32"]["stock"]
        assert len(got["warnings"]) == 1 and "not the model's own M-RoPE index" in got["warnings"][0]
        for key in ("log_probs", "entropy", "loss", "offsets"):
            assert torch.equal(got[key], ref[key]), key
        assert got["grads"].keys() == ref["grads"].keys()
        assert all(torch.equal(got["grads"][n], g) for n, g in ref["grads"].items())
        assert got["stats"]["grouped_tokens"] == 0 and got["tower_patches"] == ref["tower_patches"]


def test_ulysses_vision_language_batches_are_named(ranks):
    """Under Ulysses sequence parallelism a vision-language micro-batch is not grouped: the reason names it
    (the engine then raises, as for every ungroupable micro-batch under Ulysses)."""
    for res in ranks:
        assert "Ulysses" in res["ulysses_reason"] and "multimodal" in res["ulysses_reason"]
