"""FlexAttention backends: ``flex`` (torch.compile'd) and ``flex_eager`` (uncompiled, for tests).

Plan (once per forward, one call into the masks layer, :func:`flexgroup.masks.flex_inputs`): the
layout padded with a separate padding tree to a multiple of 128 tokens (compiled kernel: on every
device, so that lengths bucket to 128 and the CPU kernel only ever sees the row lengths it computes
correctly), its analytic BlockMask (block tables' sizes marked dynamic once here), and the score_mod
wrapped to read virtual positions. Per layer: pad q/k/v, run the
kernel, cut the padding off.

Compiled kernels: one per device type per process. On CUDA automatic dynamic shapes (a new length
compiles once, then a dynamic kernel serves all lengths); on CPU static (torch 2.13's CPU inductor
emitted uncompilable C++ for dynamic flex kernels). Past dynamo's recompile limit torch would run the
*eager* flex path, which materialises the full L x L scores (an out-of-memory at real sizes): flexgroup
asks dynamo to fail instead and raises an error that says why and what to do.

The compiled CPU kernel has returned wrong numbers silently (torch 2.13 at some lengths, torch 2.6
with some block tables), so on CPU each new kernel configuration is first checked against eager flex
on a fixed hard layout, and refused with an error if it disagrees.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..layout import Layout
from ..masks import flex_inputs, pattern_key
from ..patterns import Pattern
from ..score_mods import ScoreMod
from .base import Backend, Plan

__all__ = ["FlexBackend", "compiled_flex_attention", "PAD_MULTIPLE"]

PAD_MULTIPLE = 128
_COMPILED_FLEX: dict[str, Callable] = {}
_BLOCK_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
# dynamo's "raise instead of running eagerly past the recompile limit" switch (renamed across versions)
_FAIL_ON_LIMIT = next((n for n in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit")
                       if n in getattr(torch._dynamo.config, "_config", {})), None)
_LIMIT_ERRORS = tuple(getattr(torch._dynamo.exc, n) for n in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
                      if hasattr(torch._dynamo.exc, n))


def compiled_flex_attention(device_type: str = "cuda") -> Callable:
    """The process-wide compiled ``flex_attention`` for a device type (compiled once, then shared)."""
    if device_type not in _COMPILED_FLEX:
        dynamic = None if device_type == "cuda" else False
        _COMPILED_FLEX[device_type] = torch.compile(flex_attention, dynamic=dynamic)
    return _COMPILED_FLEX[device_type]


def _limit_name() -> str:
    c = torch._dynamo.config
    return "recompile_limit" if hasattr(c, "recompile_limit") else "cache_size_limit"


@dataclass
class FlexPlanData:
    """``block_mask``: BlockMask (1, 1, L + pad, L + pad); ``score_mod``: on physical indices or None."""

    block_mask: BlockMask
    score_mod: Callable | None
    pad: int


def _mark_dynamic(bm: BlockMask) -> None:
    # Declare the block-table sizes dynamic once per BlockMask, so that a second length does not
    # compile a static kernel first (3 compiles for 20 lengths without the marks, 2 with them).
    for name in _BLOCK_TABLES:
        t = getattr(bm, name, None)
        if t is not None:
            for d in range(2, t.ndim):
                torch._dynamo.maybe_mark_dynamic(t, d)


class FlexBackend(Backend):
    """FlexAttention with flexgroup's analytic BlockMask; GQA through ``enable_gqa`` (no K/V repeat)."""

    backward_devices = ("cuda",)  # FlexAttention has no CPU backward

    def __init__(self, compiled: bool):
        self.compiled = compiled
        self.name = "flex" if compiled else "flex_eager"
        self.exact_note = ("compiled FlexAttention (CUDA: the fast path)" if compiled
                           else "uncompiled FlexAttention: materialises L x L scores, for tests")

    def prepare(self, layout, pattern, score_mod, device, block_size: int = 128, **_) -> Plan:
        pad_to = 1
        if self.compiled:
            if device.type == "cpu":
                # only the block *tables* depend on the block size (the mask_mod is exact), and the
                # compiled CPU kernel is right only with 128-blocks on 128-multiple rows
                block_size = PAD_MULTIPLE
            pad_to = math.lcm(PAD_MULTIPLE, block_size)
        if score_mod is not None:
            score_mod = score_mod.to(device)
        bm, sm, pad = flex_inputs(layout, pattern, score_mod, device, block_size=block_size, pad_to=pad_to)
        if self.compiled and device.type != "cpu":
            _mark_dynamic(bm)
        return Plan(self.name, layout, pattern, score_mod, device, FlexPlanData(bm, sm, pad))

    def run(self, plan, q, k, v, scale):
        if self.compiled and q.device.type == "cpu":
            _check_cpu_kernel(q, k, plan.pattern, plan.score_mod, scale)
        return self._run(plan, q, k, v, scale)

    def _run(self, plan, q, k, v, scale):
        d: FlexPlanData = plan.data
        gqa = q.shape[1] != k.shape[1]
        if not self.compiled:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # eager flex warns that it is slow; that is its purpose here
                return flex_attention(q, k, v, score_mod=d.score_mod, block_mask=d.block_mask, scale=scale,
                                      enable_gqa=gqa)
        L = q.shape[2]
        if d.pad:
            q, k, v = (F.pad(t, (0, 0, 0, d.pad)) for t in (q, k, v))
        if q.device.type != "cpu":
            for t in (q, k, v):
                torch._dynamo.maybe_mark_dynamic(t, 2)
        out = _run_compiled(q, k, v, d, scale, gqa)
        return out[:, :, :L] if d.pad else out


def _run_compiled(q, k, v, d: FlexPlanData, scale: float, gqa: bool) -> torch.Tensor:
    fn = compiled_flex_attention(q.device.type)
    if _FAIL_ON_LIMIT is None:  # pragma: no cover - a torch without the switch: nothing to intercept
        return fn(q, k, v, score_mod=d.score_mod, block_mask=d.block_mask, scale=scale, enable_gqa=gqa)
    try:
        with torch._dynamo.config.patch(**{_FAIL_ON_LIMIT: True}):
            return fn(q, k, v, score_mod=d.score_mod, block_mask=d.block_mask, scale=scale, enable_gqa=gqa)
    except _LIMIT_ERRORS as e:
        limit = getattr(torch._dynamo.config, _limit_name())
        raise RuntimeError(
            f"backend='flex': torch.compile reached its recompile limit ({_limit_name()}={limit}) for "
            f"flex_attention (row of {q.shape[2]} tokens, dtype {q.dtype}, {q.shape[1]}/{k.shape[1]} heads, "
            f"head_dim {q.shape[3]}); past it torch would run uncompiled flex, which materialises the full "
            "L x L scores (an out-of-memory at real sizes), so flexgroup stops here. Raise "
            f"torch._dynamo.config.{_limit_name()}, keep row lengths, dtypes and head shapes steady, or use "
            "backend='sdpa' (exact)") from e


_CPU_KERNEL_OK: dict = {}


def _check_cpu_kernel(q, k, pat: Pattern | None, smod: ScoreMod | None, scale: float) -> None:
    """Refuse a compiled CPU flex configuration that disagrees with eager flex on a hard layout.

    Runs once per (dtype, heads, head_dim, pattern, score_mod, scale): a 166-token forest with
    groups, a deeper tree and an interleaved forest (empty, partial and full 128-blocks, padded
    rows), through the same compiled path, compared with eager flex (which computes every score).
    """
    key = (q.dtype, q.shape[1], k.shape[1], q.shape[3], pattern_key(pat), pattern_key(smod), scale)
    if key not in _CPU_KERNEL_OK:
        lay = Layout.pack([Layout.group(40, [17, 30, 9]), Layout.tree([-1, -1, 0, 1, 2, 1, 3], [9, 4, 6, 3, 2, 5, 1]),
                           Layout.tree([-1, 0, 0], [20, 5, 6])])
        g = torch.Generator().manual_seed(0)
        L, D = lay.num_tokens, q.shape[3]
        qq = torch.randn(1, q.shape[1], L, D, generator=g).to(q.dtype)
        kk, vv = (torch.randn(1, k.shape[1], L, D, generator=g).to(q.dtype) for _ in range(2))
        cpu = torch.device("cpu")
        with torch.no_grad():
            got = FLEX._run(FLEX.prepare(lay, pat, smod, cpu), qq, kk, vv, scale)
            want = FLEX_EAGER.run(FLEX_EAGER.prepare(lay, pat, smod, cpu, block_size=128), qq, kk, vv, scale)
        err = float((got.float() - want.float()).abs().max())
        tol = 1e-4 if q.dtype in (torch.float32, torch.float64) else 5e-2
        _CPU_KERNEL_OK[key] = (err <= tol, err)
    ok = _CPU_KERNEL_OK[key]
    if not ok[0]:
        raise NotImplementedError(
            f"backend='flex' on CPU: this torch build's compiled FlexAttention kernel returned wrong "
            f"numbers in flexgroup's self-check (max error {ok[1]:.3g} against eager flex for dtype "
            f"{q.dtype}, {q.shape[1]}/{k.shape[1]} heads, head_dim {q.shape[3]}). Use backend='sdpa' "
            "(exact) or 'flex_eager' on CPU."
        )


FLEX = FlexBackend(compiled=True)
FLEX_EAGER = FlexBackend(compiled=False)
