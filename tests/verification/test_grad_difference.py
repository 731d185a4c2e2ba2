"""``grad_difference`` (verify's and the demo's gradient comparison) reads the gradients it compares and never
writes them. A float64 gradient's ``.double()`` is the tensor itself: an in-place subtraction or ``abs_`` on it
rewrote the reference's gradients, so that the demo's second comparison (flexgroup vs each alone, after padded
vs each alone) saw |g| instead of g and reported a relative difference of 2 on an exact float64 run."""

from __future__ import annotations

import pytest
import torch

from flexgroup.verification.equivalence import grad_difference


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_comparing_gradients_leaves_both_sides_unchanged_and_repeats(dtype):
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(5, 7, generator=g, dtype=torch.float64).to(dtype)}
    b = {"w": a["w"] + 1e-3 * torch.randn(5, 7, generator=g, dtype=torch.float64).to(dtype)}
    before = {k: (a[k].clone(), b[k].clone()) for k in a}
    first = grad_difference(a, b)
    for k in a:
        assert torch.equal(a[k], before[k][0]) and torch.equal(b[k], before[k][1])
    assert grad_difference(a, b) == first                              # a second read sees the same gradients
    truth = ((a["w"].double() - b["w"].double()).abs().max() / b["w"].double().abs().max()).item()
    assert first[1] == pytest.approx(truth, rel=1e-12)


def test_a_model_compared_twice_against_the_same_reference_gives_zero_for_itself():
    """The demo's pattern: padded vs alone, then grouped vs alone -- here the same gradients both times."""
    m, ref = torch.nn.Linear(4, 3).double(), torch.nn.Linear(4, 3).double()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 4, dtype=torch.float64)
    for model in (m, ref):
        model(x).sum().backward()
    assert grad_difference(m, ref)[1] == 0.0
    assert grad_difference(m, ref)[1] == 0.0                           # was 2.0 when abs_ wrote the reference
