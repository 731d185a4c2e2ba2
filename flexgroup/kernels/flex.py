"""FlexAttention backends: ``flex`` (torch.compile'd) and ``flex_eager`` (uncompiled, for tests).

Plan (once per forward, :func:`flex_inputs`, one call into the masks layer for the BlockMask): the
layout padded with a separate padding tree to a multiple of 128 tokens (compiled kernel: on every
device, so that lengths bucket to 128 and the CPU kernel only ever sees the row lengths it computes
correctly), its analytic BlockMask (block tables' sizes marked dynamic once here), and the score_mod
wrapped to read virtual positions. Per layer: pad q/k/v, run the
kernel, cut the padding off.

Compiled kernels (the compile budget). Dynamo keeps its compiled graphs per code object and stops at
``torch._dynamo.config.recompile_limit`` (8) per code object; its guards split on grad mode, autocast,
dtype and on each distinct mask/score function. So flexgroup compiles one wrapper *per key* -- (device
type, dtype, grad mode, autocast, the layer's pattern and score_mod, GQA) -- each with its own code
object and so its own budget, and a training loop that mixes ``no_grad`` old-policy/reference passes,
a policy pass with grad, sliding and full layers and two dtypes never makes one key pay for another.
On CUDA (automatic dynamic shapes) the row length, every block-table size and the per-token tables
the mask closes over are marked dynamic before the first call, so each key compiles at its first
length and once more, dynamic, at its second -- then never again (``benchmarks/compile_budget.py``
counts it over a 200-step GRPO loop: 2 graphs per key, see benchmarks/README.md). On CPU kernels are
static (torch 2.13's CPU inductor emitted uncompilable C++ for dynamic flex kernels): one graph per
128-token length bucket and key.

Never crash, never eager. Past the recompile limit torch would run the *eager* flex path, which
materialises the full L x L scores (an out-of-memory at real sizes). flexgroup asks dynamo to fail
instead and then runs the exact ``sdpa`` backend for that call and for the rest of the process, with
one warning that says why, how many graphs were built and how to raise the limit.

The compiled CPU kernel has returned wrong numbers silently (torch 2.13 at some lengths, torch 2.6
with some block tables), so on CPU each new kernel configuration is first checked against eager flex
on a fixed hard layout, and refused with an error if it disagrees.
"""

from __future__ import annotations

import contextlib
import math
import types
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..layout import Layout, masks
from ..layout.patterns import Pattern
from ..layout.score_mods import ScoreMod
from .base import Backend, Plan
from .sdpa import SDPA

__all__ = ["FlexBackend", "flex_inputs", "compiled_flex_attention", "compiled_graphs", "PAD_MULTIPLE",
           "CompileProfile", "PROFILES", "cuda_profile_on_cpu"]

PAD_MULTIPLE = 128
_COMPILED_FLEX: dict[tuple, Callable] = {}
_BLOCK_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
# dynamo's "raise instead of running eagerly past the recompile limit" switch (renamed across versions)
_FAIL_ON_LIMIT = next((n for n in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit")
                       if n in getattr(torch._dynamo.config, "_config", {})), None)
_LIMIT_ERRORS = tuple(getattr(torch._dynamo.exc, n) for n in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
                      if hasattr(torch._dynamo.exc, n))


@dataclass(frozen=True)
class CompileProfile:
    """How flex kernels are compiled on one device type.

    ``dynamic``: None = automatic dynamic shapes with the lengths marked dynamic up front (CUDA);
    False = a static kernel per padded length (CPU). ``backend``: torch.compile's backend.
    ``self_check``: compare each new kernel configuration with eager flex first (the CPU kernel has
    been silently wrong)."""

    dynamic: bool | None
    backend: str = "inductor"
    self_check: bool = False


PROFILES: dict[str, CompileProfile] = {"cuda": CompileProfile(None), "cpu": CompileProfile(False, self_check=True)}


@contextlib.contextmanager
def cuda_profile_on_cpu(backend: str = "aot_eager"):
    """Count the CUDA compile budget on a CPU machine: CPU flex kernels compiled the CUDA way (automatic
    dynamic shapes, lengths marked dynamic) with ``backend``, differentiable (``aot_eager`` runs
    FlexAttention's reference backward, which torch refuses on CPU only for its inductor kernel), and
    no CPU self-check. Compiled kernels made inside are dropped on exit. For benchmarks and tests."""
    import torch.nn.attention.flex_attention as fa

    saved = dict(PROFILES), FLEX.backward_devices, dict(_COMPILED_FLEX), dict(_GRAPH_CODES)
    validate = fa._validate_device
    fa._validate_device = lambda *a: None  # it refuses requires_grad on CPU (for the inductor kernel)
    PROFILES["cpu"] = CompileProfile(None, backend=backend)
    FLEX.backward_devices = None
    _COMPILED_FLEX.clear()
    _GRAPH_CODES.clear()
    try:
        yield
    finally:
        fa._validate_device = validate
        PROFILES.clear()
        PROFILES.update(saved[0])
        FLEX.backward_devices = saved[1]
        for d, s in ((_COMPILED_FLEX, saved[2]), (_GRAPH_CODES, saved[3])):
            d.clear()
            d.update(s)


def _profile(device_type: str) -> CompileProfile:
    return PROFILES.get(device_type, PROFILES["cuda"])


def _flex_call(q, k, v, score_mod, block_mask, scale, enable_gqa):
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def compiled_flex_attention(device_type: str = "cuda", key: tuple = ()) -> Callable:
    """The process-wide compiled ``flex_attention`` for a device type and kernel key (compiled once, shared).

    Called as ``fn(q, k, v, score_mod, block_mask, scale, enable_gqa)``. Each key gets its own code
    object, so dynamo's per-code-object recompile limit applies per key (see the module docstring).
    """
    full = (device_type, *key)
    if full not in _COMPILED_FLEX:
        name = f"flexgroup_flex_{len(_COMPILED_FLEX)}"
        code = _flex_call.__code__.replace(co_name=name, **({"co_qualname": name} if hasattr(
            _flex_call.__code__, "co_qualname") else {}))
        fn = types.FunctionType(code, _flex_call.__globals__, name)
        prof = _profile(device_type)
        _COMPILED_FLEX[full] = torch.compile(fn, dynamic=prof.dynamic, backend=prof.backend)
        _GRAPH_CODES[full] = code
    return _COMPILED_FLEX[full]


_GRAPH_CODES: dict[tuple, types.CodeType] = {}


def compiled_graphs() -> dict[tuple, int]:
    """``{(device type, *kernel key): graphs dynamo holds for it}`` -- the compile budget spent so far."""
    entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None) or getattr(
        torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list")
    return {k: len(entries(c)) for k, c in _GRAPH_CODES.items()}


def _kernel_key(q, k, plan) -> tuple:
    """What really changes a compiled flex graph besides the length (marked dynamic)."""
    dev = q.device.type
    return (q.dtype, torch.is_grad_enabled() and any(t.requires_grad for t in (q, k)),
            torch.is_autocast_enabled(dev) if dev in ("cuda", "cpu") else False,
            _kind(plan.pattern), _kind(plan.score_mod), q.shape[1] != k.shape[1])


def _kind(fn) -> object:
    """flexgroup's own (frozen) patterns and score_mods by value -- a model has a few; a user callable by
    its code, so that a fresh closure each step shares one budget instead of compiling a new key."""
    if fn is None or getattr(fn, "frozen", False):
        return masks.pattern_key(fn)
    inner = getattr(fn, "fn", fn)
    return getattr(inner, "__code__", None) or type(inner)


_FALLBACK: dict[str, str] = {}  # "why": the warning text, once the recompile limit was reached


def _limit_name() -> str:
    c = torch._dynamo.config
    return "recompile_limit" if hasattr(c, "recompile_limit") else "cache_size_limit"


def _on_virtual_positions(smod: ScoreMod, pos: torch.Tensor) -> Callable:
    """A FlexAttention score_mod on physical indices that calls ``smod`` on virtual positions (``pos``: [L])."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return smod(score, b, h, pos[q_idx], pos[kv_idx])

    return score_mod


def flex_inputs(layout: Layout, pattern: Callable | None, score_mod: ScoreMod | None, device: torch.device,
                block_size: int = 128, pad_to: int = 1) -> tuple[BlockMask, Callable | None, int]:
    """What FlexAttention needs for ``layout``, in one call: ``(block_mask, score_mod, pad)``.

    The layout is padded with a separate padding tree to a multiple of ``pad_to`` tokens (``pad``
    tokens; 1: no padding); ``block_mask`` is its analytic BlockMask (1, 1, L + pad, L + pad) on
    ``device`` (cached, see :func:`flexgroup.layout.masks.block_mask`); ``score_mod`` (a :class:`ScoreMod`
    already on ``device``, or None) is wrapped to read virtual positions ([L + pad]) from physical indices.
    """
    padded = layout.padded(pad_to)
    pad = padded.num_tokens - layout.num_tokens
    bm = masks.block_mask(padded, pattern, device=device, block_size=block_size)
    sm = None if score_mod is None else _on_virtual_positions(score_mod, padded.position_ids.to(device))
    return bm, sm, pad


@dataclass
class FlexPlanData:
    """``block_mask``: BlockMask (1, 1, L + pad, L + pad); ``score_mod``: on physical indices or None."""

    block_mask: BlockMask
    score_mod: Callable | None
    pad: int
    sdpa_plan: Plan | None = None  # set once the process fell back to sdpa (recompile limit reached)


def _mark_dynamic(bm: BlockMask, *per_token: torch.Tensor) -> None:
    """Declare every length-dependent size dynamic before the first call -- the block tables' block
    counts, and the per-token tables ([L]) that the mask_mod (and score_mod) close over, found in their
    closures (0-d constants left alone) -- so that the second length compiles the dynamic kernel that
    serves every later one (the BlockMask's Python-int lengths still specialise the first graph)."""
    for name in _BLOCK_TABLES:
        t = getattr(bm, name, None)
        if t is not None:
            for d in range(2, t.ndim):
                torch._dynamo.maybe_mark_dynamic(t, d)
    for t in (*per_token, *_closure_tensors(bm.mask_mod)):
        if t.ndim == 1:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def _closure_tensors(fn, depth: int = 0) -> list[torch.Tensor]:
    out = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            x = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif callable(x) and depth < 3 and hasattr(x, "__closure__"):
            out += _closure_tensors(x, depth + 1)
    return out


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
        if self.compiled and _FALLBACK:  # past the recompile limit: the exact sdpa backend from now on
            return SDPA.prepare(layout, pattern, score_mod, device)
        if score_mod is not None:
            score_mod = score_mod.to(device)
        bm, sm, pad = flex_inputs(layout, pattern, score_mod, device, block_size=block_size, pad_to=pad_to)
        if self.compiled and _profile(device.type).dynamic is None:
            _mark_dynamic(bm, *(_closure_tensors(sm) if sm is not None else []))
        return Plan(self.name, layout, pattern, score_mod, device, FlexPlanData(bm, sm, pad))

    def run(self, plan, q, k, v, scale):
        if self.compiled and _FALLBACK:
            return _sdpa_fallback(plan, q, k, v, scale)
        if self.compiled and _profile(q.device.type).self_check:
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
        if _profile(q.device.type).dynamic is None:
            for t in (q, k, v):
                torch._dynamo.maybe_mark_dynamic(t, 2)
        out = _run_compiled(q, k, v, d, scale, gqa, _kernel_key(q, k, plan))
        if out is None:  # the recompile limit was reached just now
            return _sdpa_fallback(plan, q[:, :, :L], k[:, :, :L], v[:, :, :L], scale)
        return out[:, :, :L] if d.pad else out


def _run_compiled(q, k, v, d: FlexPlanData, scale: float, gqa: bool, key: tuple) -> torch.Tensor | None:
    """The compiled kernel's output, or None when dynamo reached its recompile limit for ``key`` (then
    every later call runs the exact sdpa backend: see :func:`_sdpa_fallback`)."""
    fn = compiled_flex_attention(q.device.type, key)
    if _FAIL_ON_LIMIT is None:  # pragma: no cover - a torch without the switch: nothing to intercept
        return fn(q, k, v, d.score_mod, d.block_mask, scale, gqa)
    try:
        with torch._dynamo.config.patch(**{_FAIL_ON_LIMIT: True}):
            return fn(q, k, v, d.score_mod, d.block_mask, scale, gqa)
    except _LIMIT_ERRORS:
        _fall_back(q, k, key)
        return None


def _fall_back(q, k, key: tuple) -> None:
    """Switch the process to the sdpa backend, with one warning that says why and what to do."""
    limit, name = getattr(torch._dynamo.config, _limit_name()), _limit_name()
    graphs = compiled_graphs()
    here = graphs.get((q.device.type, *key), 0)
    _FALLBACK["why"] = (
        f"flexgroup: torch.compile reached its recompile limit (torch._dynamo.config.{name}={limit}) for "
        f"compiled flex_attention after {here} graphs for this kernel ({sum(graphs.values())} flex graphs in "
        f"all; row of {q.shape[2]} tokens, {q.dtype}, {q.shape[1]}/{k.shape[1]} heads, head_dim {q.shape[3]}, "
        f"grad {key[1]}). Past the limit torch would run uncompiled flex, which materialises the full L x L "
        "scores (an out-of-memory at real sizes), so flexgroup runs the exact 'sdpa' backend instead for the "
        "rest of this process: same numbers, slower on GPU. To keep the compiled kernel, raise the limit "
        f"before training (torch._dynamo.config.{name} = {max(2 * limit, 64)}) or keep dtypes and patterns "
        "steady; see benchmarks/README.md (compile budget).")
    warnings.warn(_FALLBACK["why"], RuntimeWarning, stacklevel=4)


def _sdpa_fallback(plan: Plan, q, k, v, scale: float) -> torch.Tensor:
    """``plan``'s layer through the exact sdpa backend (its plan built once and kept on ``plan``)."""
    d: FlexPlanData = plan.data
    if d.sdpa_plan is None:
        d.sdpa_plan = SDPA.prepare(plan.layout, plan.pattern, plan.score_mod, q.device)
    return SDPA.run(d.sdpa_plan, q, k, v, scale)


_CPU_KERNEL_OK: dict = {}
CPU_CHECK_CACHE_SIZE = 64  # verdicts kept (flexgroup/caches.py): a fresh user callable per step must not grow it


def _check_cpu_kernel(q, k, pat: Pattern | None, smod: ScoreMod | None, scale: float) -> None:
    """Refuse a compiled CPU flex configuration that disagrees with eager flex on a hard layout.

    Runs once per (dtype, heads, head_dim, pattern, score_mod, scale): a 166-token forest with
    groups, a deeper tree and an interleaved forest (empty, partial and full 128-blocks, padded
    rows), through the same compiled path, compared with eager flex (which computes every score).
    """
    key = (q.dtype, q.shape[1], k.shape[1], q.shape[3], masks.pattern_key(pat), masks.pattern_key(smod), scale)
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
        while len(_CPU_KERNEL_OK) > CPU_CHECK_CACHE_SIZE:
            _CPU_KERNEL_OK.pop(next(iter(_CPU_KERNEL_OK)))  # the oldest verdict
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
