"""score_mods on the exact sdpa backend broadcast as FlexAttention's do (it applies them per element).

Oracle: each sequence [P; R_i] alone, plain causal attention written out (float64, GQA 4/2 heads).
A constant score makes attention the running mean of the values a token sees; a score that depends
on the query only changes nothing (softmax is invariant to a per-row constant).
"""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup import Layout

P, R = 5, (2, 3)
HQ, HKV, D = 4, 2, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    L = P + sum(R)
    q, k, v = (torch.randn(1, h, L, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV))
    return Layout.group(P, list(R)), q, k, v


def _alone(q, k, v, constant: bool):
    """Per-sequence reference rows: dict packed index -> [Hq, D]."""
    out, start = {}, P
    for r in R:
        idx = torch.cat([torch.arange(P), torch.arange(start, start + r)])
        qs, ks, vs = q[0][:, idx], k[0][:, idx].repeat_interleave(HQ // HKV, 0), v[0][:, idx].repeat_interleave(HQ // HKV, 0)
        n = idx.numel()
        scores = torch.zeros(HQ, n, n, dtype=q.dtype) if constant else qs @ ks.transpose(-1, -2) / D ** 0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        o = torch.softmax(scores, -1) @ vs                                        # [Hq, n, D]
        for t, i in enumerate(idx.tolist()):
            out[i] = o[:, t]
        start += r
    return out


@pytest.mark.parametrize("make", [lambda: torch.tensor(0.5), lambda: 0.5], ids=["0-d tensor", "python float"])
def test_a_constant_score_mod_gives_the_running_mean_of_values(make):
    lay, q, k, v = _inputs()
    got = flexgroup.attention(q, k, v, lay, score_mod=lambda s, b, h, qi, kv: make(), backend="sdpa")
    for i, ref in _alone(q, k, v, constant=True).items():
        torch.testing.assert_close(got[0, :, i], ref, atol=1e-12, rtol=0)


def test_a_score_mod_of_the_query_position_only_broadcasts():
    lay, q, k, v = _inputs()
    got = flexgroup.attention(q, k, v, lay, score_mod=lambda s, b, h, qi, kv: s + qi.to(s.dtype) * 0 + 3.0,
                              backend="sdpa")
    row_only = flexgroup.attention(q, k, v, lay, score_mod=lambda s, b, h, qi, kv: qi.to(s.dtype), backend="sdpa")
    ref = _alone(q, k, v, constant=False)
    for i, r in ref.items():
        torch.testing.assert_close(got[0, :, i], r, atol=1e-12, rtol=0)
    # a per-query constant (shape [.., n, 1]) is the constant case row by row
    for i, r in _alone(q, k, v, constant=True).items():
        torch.testing.assert_close(row_only[0, :, i], r, atol=1e-12, rtol=0)


def test_a_score_mod_result_that_cannot_broadcast_is_named():
    lay, q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"score_mod returned shape \(3,\), which does not broadcast"):
        flexgroup.attention(q, k, v, lay, score_mod=lambda s, b, h, qi, kv: torch.zeros(3), backend="sdpa")
