"""Attention of a streamed chunk: the chunk's queries against ``[kept K/V of its ancestors ; own K/V]``.

When a tree is larger than one forward (:func:`flexgroup.stream_backward`), its shared segments run
once and their per-layer keys and values (after RoPE) are kept; a later chunk's forward computes
K/V for its own tokens only and attends to the kept ones as well. Described by one
:class:`~flexgroup.layout.Layout` over ``context + queries``:

- the first ``n_context`` tokens are the *context*: whole segments, every ancestor of a query
  segment that is not itself in the chunk (their K/V come from earlier forwards);
- the remaining ``Q`` tokens are the chunk's *queries* (whole segments too), in row order.

Since the context holds every ancestor, the layout's virtual positions are the tokens' true
positions, so sliding windows, chunks and score_mods on virtual positions reach back into the kept
keys exactly. Two plans, as for a packed row:

- the ``lse`` plan (:mod:`flexgroup.kernels.lse_plan`, where a fused kernel returning the LSE exists
  and there is no score_mod): parts for the query segments only -- each query segment's own keys
  causally, and its ancestors' keys (kept context and earlier segments of the chunk) unmasked --,
  merged by log-sum-exp; no mask is built or saved where a pattern does not cut a part;
- else the exact ``sdpa`` backend's plan (:mod:`flexgroup.kernels.sdpa`) restricted to the query
  segments: per batch of query segments one gather of queries ``[G * n]`` from the chunk's ``Q``
  rows, one gather of keys ``[G * (a + n)]`` from the ``n_context + Q`` concatenated rows, one kernel
  call; ``inv [Q]`` puts the rows back.

Both run forward and backward on any device where they are available (on CUDA too: exact, not
FlexAttention).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from . import lse_ops
from ..layout import Layout
from ..layout.patterns import Pattern
from ..layout.score_mods import ScoreMod
from .base import Plan
from .lse import LSE, LseAttention, LsePlanData
from .lse_plan import Part, plan_parts, root_tokens
from .sdpa import SDPA, SdpaPlanData, _batch, plan_sdpa, sibling_batches

__all__ = ["plan_suffix", "attend_with_context"]


def _query_batches(layout: Layout, first: int) -> list[tuple[int, ...]]:
    """Segments ``>= first`` in batches: query roots alone, siblings together (as the sdpa plan batches them)."""
    roots = [(s,) for s in layout.roots if s >= first]
    sib = [tuple(s for s in b if s >= first) for b in sibling_batches(layout)]
    return roots + [b for b in sib if b]


def plan_suffix(layout: Layout, n_context: int, pattern: Pattern | None, score_mod: ScoreMod | None,
                device: torch.device) -> Plan:
    """The plan for queries = the tokens of ``layout`` from ``n_context`` on (see the module docstring).

    Args:
        layout: context segments (whole) first, then the query segments; ``n_context`` must fall on
            a segment boundary and no context segment may descend from a query segment.
        n_context: tokens of kept context (0: an ordinary packed row, planned as the sdpa backend does).
    """
    device = torch.device(device)
    smod = score_mod.to(device) if score_mod is not None else None
    lse = smod is None and lse_ops.available(device.type)
    if n_context == 0:
        if lse:
            return LSE.prepare(layout, pattern, None, device)
        return Plan(SDPA.name, layout, pattern, smod, device, plan_sdpa(layout, pattern, smod, device))
    if n_context not in layout.starts or n_context >= layout.num_tokens:
        raise ValueError(f"plan_suffix: n_context={n_context} is not a segment boundary inside the layout "
                         f"({layout!r}); the kept context must be whole segments followed by the query segments")
    first = layout.starts.index(n_context)
    if any(p >= first for p in layout.parents[:first]):
        raise ValueError("plan_suffix: a context segment descends from a query segment; order the context first")
    if lse:
        parts = [_queries_local(p, n_context) for p in plan_parts(layout, pattern, device, queries_from=n_context)]
        return Plan(LSE.name, layout, pattern, None, device, LsePlanData(parts, pattern is not None,
                                                                  root_tokens(layout).to(device)))
    pos = layout.token_tensors()["pos"]
    merged: dict[tuple[int, int], list[int]] = {}  # batches of one shape (ancestor tokens, padded length): one call
    for segs in _query_batches(layout, first):
        key = (layout.offsets[segs[0]], max(layout.lengths[s] for s in segs))
        merged.setdefault(key, []).extend(segs)
    steps, tok_parts, row_parts, base = [], [], [], 0
    for segs in merged.values():
        b, toks, rows = _batch(layout, tuple(segs), pos, pattern, smod is not None, device)
        b.qidx = b.qidx - n_context           # queries are read from the chunk's own Q rows
        steps.append(b)
        tok_parts.append(toks - n_context)
        row_parts.append(torch.where(rows >= 0, rows + base, -1))
        base += b.G * b.n
    Q = layout.num_tokens - n_context
    inv = torch.empty(Q, dtype=torch.long)
    rows = torch.cat(row_parts)
    inv[torch.cat(tok_parts)] = torch.where(rows >= 0, rows, base)  # base: the appended zero row
    return Plan(SDPA.name, layout, pattern, smod, device, SdpaPlanData(steps, inv.to(device)))


def _queries_local(p: Part, n_context: int) -> Part:
    """``p`` with its query-side indices moved from the layout's rows to the chunk's ``Q`` query rows; its
    keys stay rows of ``[context ; chunk]`` (an own part's keys, its query rows, are made explicit)."""
    shift = None if p.q_start is None else p.q_start - n_context
    return dataclasses.replace(p, qidx=p.qidx - n_context, tokens=p.tokens - n_context, q_start=shift,
                               kidx=p.qidx if p.kidx is None else p.kidx)


def attend_with_context(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        k_context: Sequence[torch.Tensor], v_context: Sequence[torch.Tensor],
                        scale: float) -> torch.Tensor:
    """q [1, Hq, Q, D], k/v [1, Hkv, Q, D] -> [1, Hq, Q, D].

    ``k_context`` / ``v_context``: the kept pieces' keys / values, each [1, Hkv, n_i, D], in the layout's
    context order (sum of n_i = n_context; empty without context); joined with k / v in one copy."""
    if k_context:
        k = torch.cat([*(x.to(k.dtype) for x in k_context), k], 2)
        v = torch.cat([*(x.to(v.dtype) for x in v_context), v], 2)
    n_ctx = plan.layout.num_tokens - q.shape[2]
    if k.shape[2] != plan.layout.num_tokens or n_ctx < 0:
        raise RuntimeError(f"attend_with_context: {q.shape[2]} queries and {k.shape[2]} keys do not fit the chunk's "
                           f"layout of {plan.layout.num_tokens} tokens; please report it")
    if plan.backend == LSE.name:
        return LseAttention.apply(q, k, v, plan.data, scale)
    return SDPA.run(plan, q, k, v, scale)
