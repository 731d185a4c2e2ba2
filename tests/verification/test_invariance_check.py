"""``check_batch_invariance``: the users' check that a grouped forward is batch-invariant (issue 43, item 5)."""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup.models.zoo import build_model
from flexgroup.kernels import lse
from flexgroup.verification.invariance import check_batch_invariance


def _sequences() -> list[torch.Tensor]:
    """Two trees: a prompt with three continuations, and a lone sequence."""
    g = torch.Generator().manual_seed(0)
    p = torch.cat([torch.tensor([5]), torch.randint(3, 128, (30,), generator=g)])
    seqs = [torch.cat([p, torch.randint(3, 128, (n,), generator=g)]) for n in (10, 23, 7)]
    return seqs + [torch.cat([torch.tensor([9]), torch.randint(3, 128, (30,), generator=g)])]


def test_a_patched_tiny_model_is_reported_batch_invariant():
    model = flexgroup.patch(build_model("llama"), backend="lse")
    report = check_batch_invariance(model, _sequences())
    assert report.invariant, str(report)
    names = [a.name for a in report.arrangements]
    assert names[:2] == ["after the neighbours", "before the neighbours"]
    assert names[2:7] == [f"sequence {i} alone vs in the batch" for i in range(4)] + [
        "beside a sequence that shares the first half of sequence 0"]
    assert len(names) == 9                                                  # + each tree alone
    assert str(report).startswith("batch-invariant forward: yes")
    assert set(report.linear_rows) == {"64->64 float32", "64->32 float32", "64->128 float32", "128->64 float32"}


def test_the_sdpa_backend_is_reported_invariant_to_row_mates():
    """The sdpa backend's per-segment calls are not designed to be invariant to the trie around a sequence
    (torch 2.13's kernels differ there, 2.6's happened not to on these sequences): only row-mates are asserted,
    and that the verdict is what the arrangements say."""
    report = check_batch_invariance(flexgroup.patch(build_model("llama"), backend="sdpa"), _sequences())
    equal = {a.name: a.equal for a in report.arrangements}
    assert equal["after the neighbours"] and equal["before the neighbours"]
    assert report.invariant == all(equal.values())
    assert str(report).startswith(f"batch-invariant forward: {'yes' if report.invariant else 'NO'}")


def test_a_forward_that_mixes_trees_is_reported_with_its_difference(monkeypatch):
    def row_mean(k, roots):  # the keys centred over the whole row, as the lse backend did before issue 43
        return k - k.mean(dim=2, keepdim=True, dtype=torch.float32).to(k.dtype)

    monkeypatch.setattr(lse, "centre_keys", row_mean)
    model = flexgroup.patch(build_model("llama"), backend="lse")
    report = check_batch_invariance(model, _sequences())
    assert not report.invariant
    bad = [a for a in report.arrangements if not a.equal]
    assert bad and all(0 < a.max_abs_diff < 1e-4 for a in bad)
    assert "batch-invariant forward: NO" in str(report) and "differ, max |diff|" in str(report)


def test_an_unpatched_model_is_refused():
    with pytest.raises(ValueError, match="not patched; call flexgroup.patch"):
        check_batch_invariance(build_model("llama"), _sequences())
