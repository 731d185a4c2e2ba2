"""verify's calibration: float64 where the copy fits, the same truth layer by layer beyond, and it says which."""

from __future__ import annotations

import pytest
import torch

from flexgroup import GroupedBatch
from flexgroup.cli import main
from flexgroup.verification.equivalence import verify
from flexgroup.models.zoo import build_model

TIGHT = {"logits": 1e-12, "logprobs": 1e-12, "grads": 1e-12}  # no float32 run meets these: the verdict is the calibration's


def batch(vocab: int = 128, seed: int = 0) -> GroupedBatch:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g)  # noqa: E731
    return GroupedBatch.from_groups([ids(20), ids(5)], [[ids(7), ids(1), ids(13)], [ids(4), ids(9)]])


def just_over_the_limit():
    """A 6-layer random model and a float64 limit one byte below its float64 copy."""
    model = build_model("llama", num_hidden_layers=6)
    return model, 8 * sum(p.numel() for p in model.parameters()) - 1


def test_a_model_just_over_the_float64_limit_is_calibrated_layer_by_layer_and_says_so():
    model, limit = just_over_the_limit()
    report = verify(model, batch(), tol=TIGHT, float64_bytes=limit)
    assert report.calibration == "layerwise" and report.reference == "float64"
    assert report.ok, report.table()
    for d in report.differences:
        assert not d.within_tol and d.calibrated and 0 < d.flex_error <= d.factor * d.stock_error
    table = report.table()
    assert "calibration: layerwise" in table and "over the" in table and "vs float64:" in table


def test_the_layerwise_truth_measures_the_same_noise_floor_as_the_float64_copy():
    model, limit = just_over_the_limit()
    layerwise = verify(model, batch(), tol=TIGHT, float64_bytes=limit)
    copy = verify(model, batch(), tol=TIGHT, calibration="float64")
    for a, b in zip(layerwise.differences, copy.differences):
        assert a.max_abs == b.max_abs  # the grouped and stock float32 runs are the same runs
        # both truths are within float32 rounding of each other, far below the float32 noise they measure
        assert 0.5 * b.stock_error <= a.stock_error <= 2 * b.stock_error, (a, b)


def test_the_layerwise_calibration_still_fails_a_leaky_mask(causal_over_packed_row):
    model, limit = just_over_the_limit()
    report = verify(model, batch(), float64_bytes=limit)
    assert report.calibration == "layerwise" and not report.ok
    for d in report.differences:
        assert not d.calibrated and d.flex_error > 100 * d.stock_error


def test_a_float64_truth_that_is_far_from_the_stock_run_is_dropped_not_trusted(monkeypatch):
    import flexgroup.verification.calibration as calibration

    truth = calibration.sequence_backward  # the truth's runs only: verify's baseline runs its own binding

    def off(*args, **kwargs):  # broken truth: logits and log-probs 0.5 off
        logits, lp = truth(*args, **kwargs)
        return logits + 0.5, lp + 0.5

    monkeypatch.setattr(calibration, "sequence_backward", off)
    model, limit = just_over_the_limit()
    report = verify(model, batch(), tol=TIGHT, float64_bytes=limit)
    assert report.calibration == "none" and report.reference is None and not report.ok
    assert "calibration layerwise dropped" in report.table()


def test_the_spread_calibration_can_be_forced_and_still_fails_a_leaky_mask(causal_over_packed_row):
    model, _ = just_over_the_limit()
    report = verify(model, batch(), calibration="spread")
    assert report.calibration == "spread" and report.reference == "stock spread" and not report.ok
    assert "vs alone:" in report.table()
    for d in report.differences:
        assert not d.calibrated and d.flex_error > 100 * d.stock_error


def test_float64_can_be_forced_past_the_limit_and_none_skips_calibration():
    model, limit = just_over_the_limit()
    forced = verify(model, batch(), tol=TIGHT, float64_bytes=limit, calibration="float64")
    assert forced.calibration == "float64" and forced.reference == "float64" and forced.ok, forced.table()
    none = verify(model, batch(), tol=TIGHT, calibration="none")
    assert none.calibration == "none" and none.reference is None and not none.ok
    assert "calibration: none" in none.table()


def test_calibration_choices_are_validated():
    model = build_model("llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match="calibration='f64'.*'spread'"):
        verify(model, batch(), calibration="f64")


@pytest.mark.parametrize("calibration, header", [("spread", "vs alone:"), ("layerwise", "vs float64:")])
def test_the_cli_forces_a_calibration(calibration, header, capsys):
    assert main(["verify", "--arch", "llama", "--calibration", calibration, "--groups", "1"]) == 0
    out = capsys.readouterr().out
    assert f"calibration: {calibration}" in out and header in out and "equivalent: yes" in out


def test_the_default_float64_budget_is_what_the_process_may_still_allocate():
    from flexgroup.verification.calibration import float64_budget as _float64_budget
    from flexgroup.verification.memory import _meminfo_available

    budget, how = _float64_budget()
    assert 0 < budget <= _meminfo_available() and "available" in how


def test_the_cli_can_freeze_the_embeddings_and_then_compares_the_other_gradients(capsys):
    assert main(["verify", "--arch", "llama", "--freeze-embeddings", "--groups", "1"]) == 0
    out = capsys.readouterr().out
    assert "embed_tokens" not in out and "lm_head" not in out and "equivalent: yes" in out


@pytest.mark.parametrize("arch", ["gemma2", "qwen3_next", "granitemoehybrid"])  # softcapped eager; GDN + MoE; Mamba2 + MoE
def test_layerwise_and_the_float64_copy_agree_on_the_noise_floor_of_other_architectures(arch):
    from flexgroup.models.zoo import unavailable

    if unavailable(arch):
        pytest.skip(unavailable(arch))
    model = build_model(arch)
    layerwise = verify(model, batch(), tol=TIGHT, calibration="layerwise")
    copy = verify(model, batch(), tol=TIGHT, calibration="float64")
    assert layerwise.ok and copy.ok, layerwise.table()
    for a, b in zip(layerwise.differences, copy.differences):
        assert 0.5 * b.stock_error <= a.stock_error <= 2 * b.stock_error, (a, b)
