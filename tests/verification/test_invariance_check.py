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


@pytest.mark.parametrize("backend", ["lse", "sdpa"])
def test_a_patched_tiny_model_is_reported_batch_invariant(backend):
    model = flexgroup.patch(build_model("llama"), backend=backend)
    report = check_batch_invariance(model, _sequences())
    assert report.invariant, str(report)
    names = [a.name for a in report.arrangements]
    assert names[:2] == ["after the neighbours", "before the neighbours"] and len(names) == 4  # + each tree alone
    assert str(report).startswith("batch-invariant forward: yes")
    assert set(report.linear_rows) == {"64->64 float32", "64->32 float32", "64->128 float32", "128->64 float32"}


def test_a_forward_that_mixes_trees_is_reported_with_its_difference(monkeypatch):
    def row_mean(k, trees):  # the keys centred over the whole row, as the lse backend did before issue 43
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
