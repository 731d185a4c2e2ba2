"""The ``lse`` backend in float32 on keys with a large common component (issue 31, item 1).

Real checkpoints carry one: Qwen2.5-Coder-0.5B-Instruct's key bias gives ``|mean k|`` about 275 per
KV head in the slowest RoPE dimensions (dims 29-31 and 59-63 of 64), with a token-to-token spread of
about 1 there, so its raw attention scores reach 1,200 while a row spans about 40 (measured on the
layers' q/k/v captured from a grouped run of its verify batch). Split into parts merged by their
log-sum-exps, such rows lost precision: each part's LSE is rounded at ``ulp(1200)``, and each part's
dq carries a large ``sum(ds) * mean(k)`` term that only cancels across parts -- dq came out 20-100x
further from a float64 truth than the stock fused kernel on each sequence alone. The backend now
centres the keys (exact: a query's scores all move by the same amount); switched off, the loss is back.

The q/k/v here are synthetic with those statistics (Qwen's GQA 14:2, head_dim 64, scale 1/8, RoPE
theta 1e6, the layout of ``flexgroup verify``'s default batch). Oracles: the float64 truth is each
sequence alone with an explicit float64 softmax (``reference_attention``); the float32 floor is each
sequence alone through torch's fused causal kernel -- what the stock model runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _core_reference import one_torch_thread, reference_attention  # noqa: F401
from flexgroup import Layout
from flexgroup.kernels import attention, lse, lse_plan

LAYOUT = Layout.pack([Layout.group(24, [5, 12, 1, 9])] * 2)
HQ, HKV, D, SCALE = 14, 2, 64, 0.125
SLOW_DIMS = [29, 30, 31, 59, 60, 61, 62, 63]   # where Qwen2.5's large key bias sits (slowest RoPE pairs)
FACTOR = 4.0                                   # verify's calibrated rule: within 4x the stock run's own error


@pytest.fixture(autouse=True)
def grid_of_8(monkeypatch):
    """A grid of 8 tokens: each query's keys come in several parts, merged by their LSEs (the case at stake)."""
    monkeypatch.setattr(lse_plan, "CHUNK", 8)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 1e6) -> torch.Tensor:
    """HF's rotate-half RoPE on ``x [H, L, D]`` at positions ``pos [L]``, float64."""
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


def qwen_like_qkv(seed: int) -> list[torch.Tensor]:
    """float32 ``q [1, 14, L, 64]``, ``k, v [1, 2, L, 64]``: keys = a common bias of norm ~275 in the slow
    RoPE dims + N(0, 2); queries partly along it, so scores reach ~1,000-1,800 while a row spans ~50."""
    g = torch.Generator().manual_seed(seed)
    L = LAYOUT.num_tokens
    bias = torch.zeros(HKV, D, dtype=torch.float64)
    bias[:, SLOW_DIMS] = torch.randn(HKV, len(SLOW_DIMS), generator=g, dtype=torch.float64) * 110
    k = bias[:, None] + 2 * torch.randn(HKV, L, D, generator=g, dtype=torch.float64)
    along = (bias / bias.norm(dim=-1, keepdim=True)).repeat_interleave(HQ // HKV, 0)[:, None]   # [HQ, 1, D]
    a = torch.empty(HQ, L, 1, dtype=torch.float64).uniform_(-15, 35, generator=g)
    q = 2 * torch.randn(HQ, L, D, generator=g, dtype=torch.float64) + a * along
    v = torch.randn(HKV, L, D, generator=g, dtype=torch.float64)
    pos = LAYOUT.position_ids
    return [_rope(q, pos)[None].float(), _rope(k, pos)[None].float(), v[None].float()]


def _each_alone_fused(q, k, v):
    """Each root-to-leaf sequence alone through torch's fused causal kernel (the stock float32 run)."""
    out = torch.zeros_like(q)
    for path in LAYOUT.paths():
        out[:, :, path] = F.scaled_dot_product_attention(q[:, :, path], k[:, :, path], v[:, :, path],
                                                         is_causal=True, scale=SCALE, enable_gqa=True)
    return out


def _errors(fn, x, weight, truth) -> list[float]:
    """Relative max errors of (out, dq, dk, dv) of ``fn`` on ``x`` against ``truth``."""
    xs = [t.detach().clone().requires_grad_() for t in x]
    out = fn(*xs)
    grads = torch.autograd.grad((out * weight.to(out.dtype)).sum(), xs)
    return [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip((out.detach(), *grads), truth)]


def _truth(x, weight):
    x64 = [t.double().requires_grad_() for t in x]
    out = reference_attention(*x64, LAYOUT, scale=SCALE)
    return [out.detach(), *torch.autograd.grad((out * weight).sum(), x64)]


def _lse(*x):
    return attention(*x, LAYOUT, scale=SCALE, backend="lse")


@pytest.mark.parametrize("seed", [0, 1])
def test_lse_stays_within_the_stock_float32_floor_when_keys_share_a_large_component(seed):
    x = qwen_like_qkv(seed)
    scores = (x[0].double() @ x[1].double().repeat_interleave(HQ // HKV, 1).transpose(-1, -2)) * SCALE
    assert scores.abs().max() > 900    # the regime measured on the real checkpoint
    weight = torch.randn(x[0].shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    truth = _truth(x, weight)
    floor = _errors(_each_alone_fused, x, weight, truth)
    got = _errors(_lse, x, weight, truth)
    for name, e, f in zip(("out", "dq", "dk", "dv"), got, floor):
        assert e <= FACTOR * f, (name, e, f)


def test_without_centred_keys_dq_leaves_the_floor(monkeypatch):
    # the broken variant: parts merged from raw scores of ~1,000 (what the backend did before issue 31)
    monkeypatch.setattr(lse, "CENTRE_KEYS", False)
    x = qwen_like_qkv(0)
    weight = torch.randn(x[0].shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    truth = _truth(x, weight)
    floor = _errors(_each_alone_fused, x, weight, truth)
    got = _errors(_lse, x, weight, truth)
    assert got[1] > 5 * FACTOR * floor[1], (got, floor)   # measured: dq 3.0e-3 against a floor of 9.6e-5


def test_centring_keeps_the_function_exact_in_float64_and_returns_the_gradient_of_the_raw_keys():
    x = [t.double() for t in qwen_like_qkv(2)]
    weight = torch.randn(x[0].shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    truth = _truth(x, weight)
    got = _errors(_lse, x, weight, truth)
    assert max(got) <= 1e-12, got
