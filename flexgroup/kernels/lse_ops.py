"""Fused attention kernels that return their log-sum-exp, and their backward given a *merged* output.

One attention *part* is ``q [G, Hq, n, D]`` against ``k, v [G, Hkv, m, D]`` (``Hq % Hkv == 0``),
either unmasked, causal (square, ``n == m``), or with an additive ``bias [G, 1, n, m]`` (0 or -inf,
dtype of q). :func:`part_forward` returns ``o [G, Hq, n, D]`` and ``lse [G, Hq, n]`` (float32, or
float64 for float64 inputs) and an opaque ``aux`` for the backward. Parts of one query row merge
exactly (``l = logaddexp(l1, l2)``, ``o = exp(l1 - l) o1 + exp(l2 - l) o2``), and
:func:`part_backward` called on each part with the MERGED ``o`` and ``l`` returns that part's exact
share of dq (summed over parts) and its dk, dv -- the rule ring attention uses.

Kernels, by feature detection (never by version):

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): any float dtype,
  GQA, a float bias;
- CUDA: ``aten._scaled_dot_product_flash_attention`` for float16/bfloat16 without bias (K/V heads
  repeated for GQA), else ``aten._scaled_dot_product_efficient_attention`` (float32 too);
- anywhere else, or for a bias on CUDA: :func:`math_forward` / :func:`math_backward` (explicit
  scores, exact, ``G * Hq * n * m`` memory) -- also the reference the kernels are tested against.

:func:`available` says whether a fused kernel exists for a device type; the ``lse`` backend falls
back to the ``sdpa`` plan where it does not.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["available", "part_forward", "part_backward", "math_forward", "math_backward", "unit_last"]

_aten = torch.ops.aten
_CPU = "_scaled_dot_product_flash_attention_for_cpu"
_CUDA_FLASH = "_scaled_dot_product_flash_attention"
_CUDA_EFF = "_scaled_dot_product_efficient_attention"


def _has(name: str) -> bool:
    return hasattr(_aten, name) and hasattr(_aten, name + "_backward")


def available(device_type: str) -> bool:
    """True where a fused kernel returning the LSE exists (CPU: the flash op; CUDA: flash or efficient)."""
    if device_type == "cpu":
        return _has(_CPU)
    if device_type == "cuda":
        return _has(_CUDA_FLASH) or _has(_CUDA_EFF)
    return False


def _repeat_kv(x: torch.Tensor, g: int) -> torch.Tensor:
    """[G, Hkv, m, D] -> [G, Hkv * g, m, D] (query head h reads kv head h // g)."""
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _sum_kv(dx: torch.Tensor, g: int) -> torch.Tensor:
    """The gradient of :func:`_repeat_kv`: [G, Hkv * g, m, D] -> [G, Hkv, m, D]."""
    if g == 1:
        return dx
    G, H, m, D = dx.shape
    return dx.view(G, H // g, g, m, D).sum(2)


_CPU_FEATURES: dict[str, bool] = {}


def _cpu_feature(name: str) -> bool:
    """Whether this torch's fused CPU op handles ``"gqa"`` (Hq != Hkv) / ``"mask"`` (a float bias), exactly.

    Probed once on a tiny float64 case against the explicit-score reference (feature detection, never
    a version string); where it raises or disagrees, K/V heads are repeated / masked parts run explicit.
    """
    if name not in _CPU_FEATURES:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, 5, 4, generator=g, dtype=torch.float64) for h in (2, 1, 1))
        bias = None
        if name == "mask":
            k, v = k.expand(1, 2, 5, 4), v.expand(1, 2, 5, 4)
            bias = torch.zeros(1, 1, 5, 5, dtype=torch.float64).masked_fill_(torch.rand(5, 5, generator=g) < 0.4,
                                                                             float("-inf"))
            bias[..., 0] = 0.0
        try:
            o, lse = getattr(_aten, _CPU)(q, k, v, 0.0, False, attn_mask=bias, scale=0.5)
            ro, rl = math_forward(q, k, v, causal=False, scale=0.5, bias=bias)
            ok = bool(torch.allclose(o, ro, atol=1e-10) and torch.allclose(lse, rl, atol=1e-10))
        except (RuntimeError, TypeError):
            ok = False
        _CPU_FEATURES[name] = ok
    return _CPU_FEATURES[name]


_WARNED: set = set()


def _warn_once(kind: str, err: Exception) -> None:
    if kind not in _WARNED:
        _WARNED.add(kind)
        warnings.warn(f"flexgroup lse backend: the fused {kind} kernel refused a part ({str(err)[:200]}); "
                      "such parts run as explicit (exact, slower) attention", RuntimeWarning, stacklevel=3)


def unit_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dimension is unit-stride, else a copy that is (same shape, values, dtype).

    The fused kernels are called through their aten ops directly, which skip the checks the public
    ``scaled_dot_product_attention`` makes: the CPU flash op reads the head dimension as if its
    stride were 1 (a head-strided view -- ``x[..., ::2]``, ``[.., D, L].transpose(-1, -2)``, a grad
    expanded from a scalar with stride 0 -- gave wrong outputs, 2.2 off, or NaN). Every tensor a
    kernel reads goes through here first.
    """
    return x if x.stride(-1) == 1 or x.numel() <= 1 else x.contiguous()


def _cuda_kind(q: torch.Tensor, bias) -> str:
    if bias is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 \
            and q.shape[-1] <= 256 and _has(_CUDA_FLASH):
        return "flash"
    if bias is None and _has(_CUDA_EFF):
        return "efficient"
    return "math"


def part_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """One part: ``(o [G, Hq, n, D], lse [G, Hq, n], aux)``.

    Rows whose every key ``bias`` masks are undefined here (the CPU kernel returns lse 0 for them):
    the caller knows them from its plan and overwrites them.
    """
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    g = q.shape[1] // k.shape[1]
    if q.device.type == "cpu" and _has(_CPU) and (bias is None or _cpu_feature("mask")):
        if g > 1 and not _cpu_feature("gqa"):
            k, v = _repeat_kv(k, g), _repeat_kv(v, g)
        mask = {} if bias is None else {"attn_mask": bias}   # unmasked calls never depend on the mask argument
        o, lse = getattr(_aten, _CPU)(q, k, v, 0.0, causal, scale=scale, **mask)
        return o, lse, ("cpu", g if g > 1 and not _cpu_feature("gqa") else 1)
    kind = _cuda_kind(q, bias) if q.device.type == "cuda" else "math"
    try:
        if kind == "flash":
            o, lse, cq, ck, mq, mk, seed, off, _ = getattr(_aten, _CUDA_FLASH)(
                q, _repeat_kv(k, g), _repeat_kv(v, g), 0.0, causal, False, scale=scale)
            return o, lse, ("flash", cq, ck, mq, mk, seed, off)
        if kind == "efficient":
            o, lse, seed, off = getattr(_aten, _CUDA_EFF)(
                q, _repeat_kv(k, g), _repeat_kv(v, g), None, True, 0.0, causal, scale=scale)
            n = q.shape[2]
            return o, lse[..., :n], ("efficient", seed, off, lse.shape[-1])  # lse may come padded to 32 rows
    except RuntimeError as e:  # a shape or dtype the fused kernel refuses: exact explicit scores instead
        _warn_once(kind, e)
    o, lse = math_forward(q, k, v, causal=causal, scale=scale, bias=bias)
    return o, lse, ("math",)


def part_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor, aux: tuple, *, causal: bool, scale: float,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [G, Hq, n, D], dk, dv [G, Hkv, m, D])`` of one part, given the merged ``o`` and ``lse [G, Hq, n]``.

    ``lse`` must be finite wherever ``grad`` is non-zero; rows to ignore carry ``grad`` 0 and a large
    finite ``lse`` (so that their probabilities are exactly 0).
    """
    grad, q, k, v, o = (unit_last(x) for x in (grad, q, k, v, o))
    g = q.shape[1] // k.shape[1]
    kind = aux[0]
    if kind == "cpu":
        rep = aux[1]
        mask = {} if bias is None else {"attn_mask": bias}
        dq, dk, dv = getattr(_aten, _CPU + "_backward")(grad, q, _repeat_kv(k, rep), _repeat_kv(v, rep), o, lse,
                                                       0.0, causal, scale=scale, **mask)
        return dq, _sum_kv(dk, rep), _sum_kv(dv, rep)
    if kind == "flash":
        _, cq, ck, mq, mk, seed, off = aux
        dq, dk, dv = getattr(_aten, _CUDA_FLASH + "_backward")(
            grad, q, _repeat_kv(k, g), _repeat_kv(v, g), o, lse.contiguous(), cq, ck, mq, mk, 0.0, causal,
            seed, off, scale=scale)
        return dq, _sum_kv(dk, g), _sum_kv(dv, g)
    if kind == "efficient":
        _, seed, off, width = aux
        lse_p = lse.new_zeros(*lse.shape[:-1], width)
        lse_p[..., :lse.shape[-1]] = lse
        dq, dk, dv, _ = getattr(_aten, _CUDA_EFF + "_backward")(
            grad, q, _repeat_kv(k, g), _repeat_kv(v, g), None, o, lse_p, seed, off, 0.0,
            [True, True, True, False], causal, scale=scale)
        return dq, _sum_kv(dk, g), _sum_kv(dv, g)
    return math_backward(grad, q, k, v, o, lse, causal=causal, scale=scale, bias=bias)


def _scores(q, k, causal, scale, bias) -> torch.Tensor:
    """[G, Hkv, g, n, m] scores in at least float32 (bias and causal mask applied)."""
    G, hq, n, d = q.shape
    hkv, m = k.shape[1], k.shape[2]
    ct = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.reshape(G, hkv, hq // hkv, n, d).to(ct), k[:, :, None].transpose(-1, -2).to(ct)) * scale
    if bias is not None:
        s = s + bias[:, :, None].to(ct)
    if causal:
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s


def math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit-score ``(o [G, Hq, n, D], lse [G, Hq, n])``; fully masked rows: lse -inf, o 0."""
    G, hq, n, d = q.shape
    s = _scores(q, k, causal, scale, bias)                              # [G, Hkv, g, n, m]
    lse = torch.logsumexp(s, dim=-1)                                    # [G, Hkv, g, n]
    p = torch.exp(s - lse.clamp_min(torch.finfo(s.dtype).min)[..., None])   # dead rows: exp(-inf) = 0
    o = torch.matmul(p, v[:, :, None].to(s.dtype))
    return o.reshape(G, hq, n, d).to(q.dtype), lse.reshape(G, hq, n)


def math_backward(grad, q, k, v, o, lse, *, causal: bool, scale: float, bias=None):
    """Explicit-score backward of one part against the merged ``o``, ``lse`` (see :func:`part_backward`)."""
    G, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s = _scores(q, k, causal, scale, bias)
    ct = s.dtype
    p = torch.exp(s - lse.reshape(G, hkv, g, n, 1).to(ct))              # [G, Hkv, g, n, m]
    g5 = grad.reshape(G, hkv, g, n, d).to(ct)
    dv = torch.matmul(p.transpose(-1, -2), g5).sum(2)                   # [G, Hkv, m, D]
    dp = torch.matmul(g5, v[:, :, None].transpose(-1, -2).to(ct))
    rowdot = (g5 * o.reshape(G, hkv, g, n, d).to(ct)).sum(-1, keepdim=True)
    ds = p * (dp - rowdot) * scale
    dq = torch.matmul(ds, k[:, :, None].to(ct)).reshape(G, hq, n, d)
    dk = torch.matmul(ds.transpose(-1, -2), q.reshape(G, hkv, g, n, d).to(ct)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
