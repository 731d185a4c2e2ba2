"""The ``lse`` backend: mask-free fused attention parts merged exactly by their log-sum-exps.

Each query token's attention is split into parts (:mod:`flexgroup.kernels.lse_plan`): its keys cut at
fixed virtual positions (one causal call for its own sub-cell, unmasked calls for the rest of its cell and
for its path before that; a pattern masks only the calls it cuts). Each part returns its output
and LSE (:mod:`flexgroup.kernels.lse_ops`); a token's parts merge as
``l = logaddexp(l1, l2)``, ``o = exp(l1 - l) o1 + exp(l2 - l) o2`` -- exact, the same softmax over
the same keys. No mask is built or read where a pattern does not cut a part.

Keys are centred first (:func:`centre_keys`): every part sees ``k - k_root`` (the key of the first token of
the query's tree, per KV head). Exact -- a query's scores all move by the same ``q . k_root``, which its
softmax ignores -- and necessary: real checkpoints carry a large common key component (Qwen2.5's
key bias: ``|mean k|`` about 275 in the slowest RoPE dimensions, token-to-token spread about 1), so
the raw scores reach 1,200 while a row spans only about 40. A part's LSE is then rounded at
``ulp(1200) = 1.2e-4``, the merge weights ``exp(l1 - l)`` inherit that error, and each part's dq
carries a large ``sum(ds) * mean(k)`` term that only cancels across parts: dq came out 10-30x further
from a float64 truth than one fused call over the same keys (measured on Qwen2.5-Coder-0.5B,
:mod:`tests.kernels.test_lse_precision`). Centred, the scores span tens, and lse's error is at or
below the one-call floor. The first token is the one key every path of a tree shares, so the shift
of a key does not depend on what else is packed (a mean over the tree's tokens would).

A token's numbers depend on its own path alone (``docs/batch-invariance.md``): the grid plan's parts, the
centring and the merge (written so that no element's bits depend on its place in the call) are all
functions of the path.

Backward (:class:`LseAttention`, a custom autograd function): the merged output ``o [L, Hq, D]``
and LSE ``[L, Hq]`` are saved with q, k, v (no per-part copies); each part's fused backward is called
with the merged ``o`` and ``l`` (ring-attention style), which gives its exact share of dq and its dk,
dv; the shares are summed into the packed gradients. Padded rows carry grad 0 and a huge LSE, so they
contribute exactly 0.

Falls back to the ``sdpa`` backend's plan (returned by :meth:`LseBackend.prepare`) where torch has
no fused kernel that returns the LSE for the device, or with a score_mod (it changes every score of
every part, so no part is mask-free; the sdpa plan's explicit math runs it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import lse_ops, lse_plan
from .base import Backend, Plan
from .lse_plan import Part, plan_parts, root_tokens
from .sdpa import SDPA

__all__ = ["LseBackend", "LseAttention", "LSE", "merge", "centre_keys"]

_BIG = 1e30  # LSE of rows to ignore in the backward: exp(score - 1e30) == 0 exactly


@dataclass
class LsePlanData:
    parts: list[Part]
    patterned: bool     # a pattern may leave a token with no key: outputs start at 0 / lse -inf
    roots: torch.Tensor  # [L] each token's tree's first token (lse_plan.root_tokens), on the plan's device


def merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor,
          safe: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two attention parts over disjoint keys of the same queries.

    ``o1, o2 [N, H, D]``, ``l1, l2 [N, H]`` -> ``(o [N, H, D], l [N, H])`` with
    ``l = logaddexp(l1, l2)`` and ``o = exp(l1 - l) o1 + exp(l2 - l) o2``. ``safe``: rows where both
    parts are empty (-inf) give o 0, l -inf instead of NaN.
    """
    # max + log1p(exp(-|d|)), not torch.logaddexp: this CPU's logaddexp gives an element other bits in a
    # vectorized block than in a loop's scalar tail, so a row's merge would depend on its place in the call
    m = torch.maximum(l1, l2)
    l = m + torch.log1p(torch.exp(-(l1 - l2).abs()))
    if safe:
        l = torch.where(m == float("-inf"), m, l)
    w1, w2 = torch.exp(l1 - l), torch.exp(l2 - l)
    if safe:
        w1, w2 = w1.nan_to_num(0.0), w2.nan_to_num(0.0)
    return w1[..., None] * o1 + w2[..., None] * o2.to(o1.dtype), l


def centre_keys(k: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
    """``k [1, Hkv, L, D]`` minus, for each token, the key of its tree's first token (a new tensor).

    ``roots [L]``: the physical index of each token's tree's first token (:func:`lse_plan.root_tokens`).
    Exact for attention: a query only sees keys of its own tree, so every score of a query moves by the
    same ``scale * q . k_root``, which its softmax (and the parts' merge) ignores; its gradient is the
    same function's, so ``dk`` of the centred keys is ``dk`` of ``k`` (see the module docstring for why
    it matters). Every path of a tree starts with that token, so a key's shift is a function of its own
    path: the same whatever else the row holds.
    """
    if not CENTRE_KEYS:
        return k
    return k - k.index_select(2, roots.to(k.device))


CENTRE_KEYS = True  # tests switch it off to show the precision loss it prevents


def _rows(xt: torch.Tensor, start: int | None, idx: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` rows of the token-major ``xt [L, ...]``: a slice at ``start``, else a gather by ``idx``."""
    return xt[start:start + count] if start is not None else xt.index_select(0, idx)


def _heads(flat: torch.Tensor, G: int, n: int) -> torch.Tensor:
    """[G * n, H, D] -> [G, H, n, D] (a view)."""
    return flat.view(G, n, *flat.shape[1:]).transpose(1, 2)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[G, H, n, ...] -> [G * n, H, ...]."""
    return x.transpose(1, 2).reshape(-1, *x.shape[1:2], *x.shape[3:])


def _kv(xt: torch.Tensor, part: Part) -> torch.Tensor:
    idx = part.kidx if part.kidx is not None else part.qidx
    return _heads(_rows(xt, part.k_start, idx, part.G * part.m), part.G, part.m)


def _add(dst: torch.Tensor, start: int | None, idx: torch.Tensor, val: torch.Tensor) -> None:
    if start is not None:
        dst[start:start + val.shape[0]] += val
    else:
        dst.index_add_(0, idx, val)


def _forward(d: LsePlanData, q, k, v, scale):
    """Merged ``o [L, Hq, D]`` (float32 for half inputs) and ``lse [L, Hq]``, and each part's aux."""
    qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))                 # [L, H, D] views
    L, Hq, D = qt.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    out = (torch.zeros if d.patterned else torch.empty)(L, Hq, D, dtype=acc, device=q.device)
    lse = None
    auxes = []
    for p in d.parts:
        qb = _heads(_rows(qt, p.q_start, p.qidx, p.G * p.n), p.G, p.n)
        o, l, aux = lse_ops.part_forward(qb, _kv(kt, p), _kv(vt, p), causal=p.causal, scale=scale,
                                         bias=p.bias(q.dtype))
        auxes.append(aux)
        o, l = _flat(o), _flat(l)                                            # [G * n, Hq, D], [G * n, Hq]
        if p.dead is not None:
            o, l = o.index_fill(0, p.dead, 0.0), l.index_fill(0, p.dead, float("-inf"))
        if p.rows is not None:
            o, l = o.index_select(0, p.rows), l.index_select(0, p.rows)
        if lse is None:
            lse = torch.full((L, Hq), float("-inf"), dtype=l.dtype, device=q.device) if d.patterned \
                else torch.empty(L, Hq, dtype=l.dtype, device=q.device)
        if p.own:
            if p.q_start is not None and p.rows is None:
                out[p.q_start:p.q_start + o.shape[0]] = o
                lse[p.q_start:p.q_start + o.shape[0]] = l
            else:
                out.index_copy_(0, p.tokens, o.to(acc))
                lse.index_copy_(0, p.tokens, l)
            continue
        N = p.G * p.n
        o_new, l_new = merge(_rows(out, p.q_start, p.tokens, N), _rows(lse, p.q_start, p.tokens, N), o, l,
                             safe=d.patterned)
        if p.q_start is not None:
            out[p.q_start:p.q_start + N] = o_new
            lse[p.q_start:p.q_start + N] = l_new
        else:
            out.index_copy_(0, p.tokens, o_new)
            lse.index_copy_(0, p.tokens, l_new)
    if lse is None:  # a pattern forbade every pair
        lse = torch.full((L, Hq), float("-inf"), dtype=acc, device=q.device)
    return out, lse, auxes


class LseAttention(torch.autograd.Function):
    """``(q, k, v [1, H, L, D], plan data, scale) -> [1, Hq, L, D]``; exact backward by merged-LSE parts."""

    @staticmethod
    def forward(ctx, q, k, v, data: LsePlanData, scale: float):
        k = centre_keys(k, data.roots)   # the backward reads the centred keys too: dk is the same (see centre_keys)
        out, lse, auxes = _forward(data, q, k, v, scale)
        o = out.to(q.dtype).transpose(0, 1)[None]                            # [1, Hq, L, D]
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.data, ctx.scale, ctx.auxes = data, scale, auxes
        return o

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse = ctx.saved_tensors
        d: LsePlanData = ctx.data
        qt, kt, vt, ot, gt = (x[0].transpose(0, 1) for x in (q, k, v, o, g))
        if d.patterned:
            lse = lse.masked_fill(lse == float("-inf"), _BIG)               # tokens with no key: grad 0
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(qt.shape, dtype=acc, device=q.device)
        dk = torch.zeros(kt.shape, dtype=acc, device=q.device)
        dv = torch.zeros(kt.shape, dtype=acc, device=q.device)
        for p, aux in zip(d.parts, ctx.auxes):
            N = p.G * p.n
            gb, lb = _rows(gt, p.q_start, p.qidx, N), _rows(lse, p.q_start, p.qidx, N)
            if p.pad is not None:
                gb, lb = gb.index_fill(0, p.pad, 0.0), lb.index_fill(0, p.pad, _BIG)
            qb = _heads(_rows(qt, p.q_start, p.qidx, N), p.G, p.n)
            ob = _heads(_rows(ot, p.q_start, p.qidx, N), p.G, p.n)
            lb = lb.view(p.G, p.n, -1).transpose(1, 2).contiguous()          # [G, Hq, n]
            dqb, dkb, dvb = lse_ops.part_backward(_heads(gb, p.G, p.n), qb, _kv(kt, p), _kv(vt, p), ob, lb,
                                                  aux, causal=p.causal, scale=ctx.scale, bias=p.bias(q.dtype))
            kidx = p.kidx if p.kidx is not None else p.qidx
            _add(dq, p.q_start, p.qidx, _flat(dqb).to(acc))
            _add(dk, p.k_start, kidx, _flat(dkb).to(acc))
            _add(dv, p.k_start, kidx, _flat(dvb).to(acc))
        return (*(x.to(q.dtype).transpose(0, 1)[None] for x in (dq, dk, dv)), None, None)


class LseBackend(Backend):
    """Exact on CPU and CUDA (forward and backward) through fused kernels that return the LSE."""

    name = "lse"
    exact_note = "fused causal / unmasked kernel parts per segment, merged by log-sum-exp"

    def settings(self) -> tuple:
        return lse_plan.CHUNK, lse_plan.SUB_CELL, lse_plan.LEVEL_FAN, lse_plan.QUERY_ROWS

    def prepare(self, layout, pattern, score_mod, device, **options) -> Plan:
        if score_mod is not None or not lse_ops.available(device.type):
            return SDPA.prepare(layout, pattern, score_mod, device, **options)
        return Plan(self.name, layout, pattern, None, device,
                    LsePlanData(plan_parts(layout, pattern, device), pattern is not None,
                                root_tokens(layout).to(device)))

    # Eager under a whole-model torch.compile, as the sdpa backend (aten kernels gain nothing from tracing).
    @torch.compiler.disable
    def run(self, plan, q, k, v, scale):
        if plan.backend == SDPA.name:  # prepare fell back to the sdpa plan
            return SDPA.run(plan, q, k, v, scale)
        return LseAttention.apply(q, k, v, plan.data, scale)


LSE = LseBackend()
