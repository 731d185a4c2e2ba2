"""The kernels layer: exact attention backends over a :class:`~flexgroup.layout.Layout`.

``BACKENDS`` maps a name to a :class:`~flexgroup.kernels.base.Backend` that declares where it runs
and where it is differentiable:

- ``"flex"``: compiled FlexAttention with the analytic BlockMask (forward and backward on CUDA;
  forward only on CPU, self-checked there) -- :mod:`flexgroup.kernels.flex`;
- ``"flex_eager"``: the same uncompiled (materialises scores; tests and debugging);
- ``"sdpa"``: exact on any device, forward and backward -- :mod:`flexgroup.kernels.sdpa`;
- ``"lse"``: exact, forward and backward: mask-free fused-kernel parts merged by log-sum-exp (CPU and
  CUDA; the ``sdpa`` plan elsewhere) -- :mod:`flexgroup.kernels.lse`;
- ``"auto"``: ``flex`` on CUDA, ``lse`` on CPU, ``sdpa`` elsewhere (torch's compiled CPU flex kernel
  was measured wrong at some lengths, and has no backward).

Two ways in: :func:`attention` (one call: plan and run), or :func:`prepare` once per forward and
:func:`run` per layer -- what the transformers glue does through the grouped-mask carrier.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable

import torch

from ..layout.checks import normal_tensors
from ..layout import Layout
from ..layout.patterns import Pattern, from_callable
from ..layout.score_mods import ScoreMod, score_mod as as_score_mod
from .base import Backend, Plan
from .flex import FLEX, FLEX_EAGER
from .lse import LSE
from .sdpa import SDPA

__all__ = ["attention", "prepare", "run", "resolve", "normalize", "BACKENDS", "BACKEND_NAMES", "Backend", "Plan"]

BACKENDS: dict[str, Backend] = {b.name: b for b in (FLEX, FLEX_EAGER, SDPA, LSE)}
BACKEND_NAMES: tuple[str, ...] = ("auto",) + tuple(BACKENDS)
_AUTO = {"cuda": "flex", "cpu": "lse"}  # device type -> backend; everything else: sdpa


def check_backend_name(backend) -> str:
    """``backend`` if it names a backend, else ValueError listing the choices."""
    if not isinstance(backend, str) or backend not in BACKEND_NAMES:
        hint = (" flash-attention kernels treat the packed row as one causal sequence (silently wrong) and "
                "are refused;" if isinstance(backend, str) and "flash" in backend else "")
        raise ValueError(f"backend={backend!r}:{hint} choose one of {BACKEND_NAMES}")
    return backend


def resolve(backend: str, device_type: str, needs_grad: bool) -> Backend:
    """The backend that runs for these inputs (``auto`` resolved); NotImplementedError if it cannot."""
    check_backend_name(backend)
    if backend == "auto":
        backend = _AUTO.get(device_type, "sdpa")
    b = BACKENDS[backend]
    why = b.refusal(device_type, needs_grad)
    if why is not None:
        raise NotImplementedError(why)
    return b


def normalize(pattern: Callable | None, score_mod: Callable | None) -> tuple[Pattern | None, ScoreMod | None]:
    """``pattern`` as a :class:`Pattern` and ``score_mod`` as a :class:`ScoreMod` (None stays None)."""
    return (from_callable(pattern) if pattern is not None else None,
            as_score_mod(score_mod) if score_mod is not None else None)


_PLANS: "OrderedDict[tuple, Plan]" = OrderedDict()
PLAN_CACHE_SIZE = 4  # sdpa plans hold [G, 1, n, a + n] masks: keep few


@torch.compiler.disable
@normal_tensors  # a plan kept in the LRU must serve a later forward with gradients
def prepare(layout: Layout, pattern: Pattern | None, score_mod: ScoreMod | None, device: torch.device,
            backend: Backend, block_size: int = 128) -> Plan:
    """The backend's per-forward plan (normalised ``pattern``/``score_mod``, see :func:`normalize`).

    Plans of frozen patterns and score_mods (flexgroup's own; see ``Pattern.frozen``) are also kept
    in a small LRU keyed by the layout's value, so a training loop that sees the same layout again
    skips the planning; a plan of a user callable is built anew on every call. Host-side work:
    under a whole-model ``torch.compile`` it runs eagerly instead of being traced into the graph.
    """
    device = torch.device(device)
    if not ((pattern is None or pattern.frozen) and (score_mod is None or score_mod.frozen)):
        return backend.prepare(layout, pattern, score_mod, device, block_size=block_size)
    key = (backend.name, layout, pattern, score_mod, str(device), block_size, backend.settings())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = backend.prepare(layout, pattern, score_mod, device, block_size=block_size)
        if len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def run(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One layer: q [1, Hq, L, D], k/v [1, Hkv, L, D] -> [1, Hq, L, D] under ``plan``."""
    return BACKENDS[plan.backend].run(plan, q, k, v, scale)


def needs_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> None:
    """ValueError/TypeError naming the bad argument unless q/k/v fit ``layout`` (one packed row)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a flexgroup.Layout, got {type(layout).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4 or t.shape[0] != 1:
            raise ValueError(f"{name} must have shape [1, H, L, D] (one packed row), got {tuple(t.shape)}")
        if t.shape[2] != layout.num_tokens:
            raise ValueError(
                f"{name} has {t.shape[2]} tokens but the layout has {layout.num_tokens}: "
                "build the layout for exactly this packed row"
            )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head_dim of q ({q.shape[3]}) and k ({k.shape[3]}) differ")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"GQA needs Hq % Hkv == 0, got Hq={q.shape[1]}, Hkv={k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


def check_scale(scale) -> float:
    """``scale`` as a float if finite and > 0, else ValueError."""
    s = float(scale)
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"scale={scale!r}: the softmax scale must be a finite number > 0 (default 1/sqrt(head_dim))")
    return s


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, *,
              pattern: Callable | None = None, score_mod: Callable | None = None,
              scale: float | None = None, backend: str = "auto", block_size: int = 128) -> torch.Tensor:
    """Exact attention over a packed row described by ``layout``.

    Every query token attends to the tokens of its own root-to-leaf sequence, causally -- the same
    context it would have if that sequence were run alone -- further restricted by ``pattern``.

    Args:
        q: [1, Hq, L, D] queries (RoPE already applied with virtual positions).
        k: [1, Hkv, L, D] keys, ``Hq % Hkv == 0`` (grouped-query attention).
        v: [1, Hkv, L, D] values.
        layout: the row's :class:`Layout`, ``layout.num_tokens == L``.
        pattern: optional ``(q_pos, kv_pos) -> BoolTensor`` on virtual positions
            (see :mod:`flexgroup.patterns`).
        score_mod: optional ``(score, b, h, q_pos, kv_pos) -> score`` on virtual positions.
        scale: softmax scale; default ``1 / sqrt(D)``.
        backend: ``"auto"``, ``"flex"``, ``"flex_eager"``, ``"sdpa"`` or ``"lse"`` (see the module docstring).
        block_size: BlockMask block size for the flex backends (the compiled CPU kernel always
            uses 128, the only size it computes correctly on every torch version tested).

    Returns:
        [1, Hq, L, D] in the dtype of ``q``.
    """
    check_inputs(q, k, v, layout)
    pat, smod = normalize(pattern, score_mod)
    if smod is not None:
        smod.check_heads(q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else check_scale(scale)
    b = resolve(backend, q.device.type, needs_grad(q, k, v))
    return run(prepare(layout, pat, smod, q.device, b, block_size), q, k, v, scale)

from ..submodules import loader as _loader

__getattr__ = _loader(__name__)  # a submodule (flexgroup.kernels.<module>) loads on first use
