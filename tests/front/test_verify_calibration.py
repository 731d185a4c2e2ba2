"""verify's calibration: float64 where the copy fits, the stock model's own spread beyond, and it says which."""

from __future__ import annotations

import pytest
import torch

from flexgroup import GroupedBatch
from flexgroup.cli import main
from flexgroup.equivalence import verify
from flexgroup.models import build_model

TIGHT = {"logits": 1e-12, "logprobs": 1e-12, "grads": 1e-12}  # no float32 run meets these: the verdict is the calibration's


def batch(vocab: int = 128, seed: int = 0) -> GroupedBatch:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g)  # noqa: E731
    return GroupedBatch.from_groups([ids(20), ids(5)], [[ids(7), ids(1), ids(13)], [ids(4), ids(9)]])


def just_over_the_limit():
    """A 6-layer random model and a float64 limit one byte below its float64 copy."""
    model = build_model("llama", num_hidden_layers=6)
    return model, 8 * sum(p.numel() for p in model.parameters()) - 1


def test_a_model_just_over_the_float64_limit_is_calibrated_on_its_own_spread_and_says_so():
    model, limit = just_over_the_limit()
    report = verify(model, batch(), tol=TIGHT, float64_bytes=limit)
    assert report.calibration == "spread" and report.reference == "stock spread"
    assert report.ok, report.table()
    for d in report.differences:
        assert not d.within_tol and d.calibrated and 0 < d.flex_error <= d.factor * d.stock_error
    table = report.table()
    assert "calibration: spread" in table and "over the" in table and "vs alone:" in table


def test_the_spread_calibration_still_fails_a_leaky_mask(causal_over_packed_row):
    model, limit = just_over_the_limit()
    report = verify(model, batch(), float64_bytes=limit)
    assert report.calibration == "spread" and not report.ok
    for d in report.differences:
        assert not d.calibrated and d.flex_error > 100 * d.stock_error


def test_float64_can_be_forced_past_the_limit_and_none_skips_calibration():
    model, limit = just_over_the_limit()
    forced = verify(model, batch(), tol=TIGHT, float64_bytes=limit, calibration="float64")
    assert forced.calibration == "float64" and forced.reference == "float64" and forced.ok, forced.table()
    none = verify(model, batch(), tol=TIGHT, calibration="none")
    assert none.calibration == "none" and none.reference is None and not none.ok
    assert "calibration: none" in none.table()


def test_calibration_choices_are_validated_and_the_older_reference_spelling_still_works():
    model = build_model("llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match="calibration='f64'.*'spread'"):
        verify(model, batch(), calibration="f64")
    assert verify(model, batch(), reference=None).calibration == "none"
    assert verify(model, batch(), reference="float64").calibration == "float64"


def test_the_cli_forces_the_spread_calibration(capsys):
    assert main(["verify", "--arch", "llama", "--calibration", "spread", "--groups", "1"]) == 0
    out = capsys.readouterr().out
    assert "calibration: spread" in out and "vs alone:" in out and "equivalent: yes" in out


def test_the_default_float64_budget_follows_the_memory_available_and_is_at_least_4_gib():
    from flexgroup.calibration import float64_budget as _float64_budget

    budget, how = _float64_budget()
    assert budget >= 4 * 2**30 and ("available" in how)


def test_the_cli_can_freeze_the_embeddings_and_then_compares_the_other_gradients(capsys):
    assert main(["verify", "--arch", "llama", "--freeze-embeddings", "--groups", "1"]) == 0
    out = capsys.readouterr().out
    assert "embed_tokens" not in out and "lm_head" not in out and "equivalent: yes" in out
