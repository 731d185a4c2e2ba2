"""verify states its resolving power: the largest difference its verdict lets pass at the run's dtype (the
tolerance, or the calibration factor times the stock run's own error against float64), so that a "yes" in bfloat16
is read right -- a leak below the stock bfloat16 run's own error passes there, and the report says so.

The leak: flexgroup's attention blended with a small share of plain causal attention over the packed row (responses
see their siblings). Its size is measured by verify itself in float32 against each sequence run alone through the
unpatched model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_verify import groups_batch

from flexgroup.models.zoo import build_model
from flexgroup.verification.equivalence import verify


@pytest.fixture
def small_leak(monkeypatch):
    from flexgroup.kernels.lse import LseBackend
    from flexgroup.kernels.sdpa import SdpaBackend

    for cls in (LseBackend, SdpaBackend):
        right = cls.run

        def leaky(self, plan, q, k, v, scale, right=right):
            rep = q.shape[1] // k.shape[1]
            wrong = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                   is_causal=True, scale=scale)
            out = right(self, plan, q, k, v, scale)
            return out + 0.015 * (wrong - out)

        monkeypatch.setattr(cls, "run", leaky)


def test_a_leak_below_the_bfloat16_resolution_passes_there_and_the_report_says_so(small_leak):
    f32 = verify(build_model("llama"), groups_batch(), dtype=torch.float32)
    leak = f32["logprobs"].max_abs
    assert not f32["logprobs"].ok and f32["logprobs"].resolution < leak       # float32 resolves it: "no"
    bf16 = verify(build_model("llama"), groups_batch(), dtype=torch.bfloat16)
    lp = bf16["logprobs"]
    assert lp.ok and lp.resolution > leak                                      # the bf16 "yes" ...
    table = bf16.table()                                                       # ... says what it cannot see
    assert f"resolving power: at bfloat16 differences below {lp.resolution:.2e} in log-probs" in table
    for report in (f32, bf16):
        for d in report.differences:                                           # the structured result
            assert report.calibration == "float64" and d.stock_error is not None
            assert d.resolution == max(d.tol, d.factor * d.stock_error)


def test_without_calibration_the_resolving_power_is_the_tolerance():
    report = verify(build_model("llama"), groups_batch(), calibration="none", tol={"logprobs": 3e-5})
    assert report.ok, report.table()
    assert report["logprobs"].resolution == 3e-5
    assert "differences below 3.00e-05 in log-probs" in report.table()
