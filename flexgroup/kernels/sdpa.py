"""The exact ``sdpa`` backend: per-segment attention through ``F.scaled_dot_product_attention``.

Queries of a segment attend to the keys of its ancestor segments and causally to their own, so only
allowed pairs are computed -- never a dense ``L x L`` mask (FIELD-NOTES: with long responses a dense
mask loses everything shared prefixes gain). Runs forward and backward on any device.

Plan (once per forward, shared by every layer and the backward):

- a root segment without pattern or score_mod is one causal call on a slice (``is_causal=True``);
  several such roots of one length (a pack of groups) run as one causal call on gathered rows;
- every other segment joins a *batch*: siblings (same ancestors) sorted by length and cut so that
  real tokens fill >= 75 % of the padded batch, or a batch of one; batches of the same shape (same
  ancestor count ``a`` and padded length ``n``, e.g. the responses of every group in a pack) merge
  into one. A batch of G segments holds one query gather index ``[G * n]``, one key gather index
  ``[G * (a + n)]`` (each row its own ancestors, then itself) and a bool mask ``[G, 1, n, a + n]``;
  each layer reads q, k and v with one ``index_select`` each and makes one kernel call;
- ``inv [L]``: where each token's output row sits in the concatenated outputs of all calls. Rows
  that may attend nothing (a pattern can forbid every key) read key 0 in the kernel and are pointed
  at an appended zero row, as FlexAttention returns 0 for them; padded rows are never read.

With a score_mod the same batches run as explicit math (softmax in at least float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..layout import Layout
from ..layout.score_mods import ScoreMod
from .base import Backend, Plan

__all__ = ["SdpaBackend", "sibling_batches"]

MIN_FILL = 0.75


@dataclass
class _Causal:
    """A root segment without pattern: tokens ``[start, start + n)`` attend causally to themselves."""

    start: int
    n: int


@dataclass
class _Batch:
    """G segments padded to n query rows, each against its a ancestor keys and its own n keys."""

    G: int
    n: int
    m: int                      # a + n keys per segment
    qidx: torch.Tensor          # [G * n] physical query rows
    kidx: torch.Tensor          # [G * m] physical key rows
    mask: torch.Tensor | None   # [G, 1, n, m] bool; None: causal roots of equal length (is_causal)
    q_pos: torch.Tensor | None  # [G, 1, 1, n, 1] virtual positions (score_mod only)
    kv_pos: torch.Tensor | None  # [G, 1, 1, 1, m]


@dataclass
class SdpaPlanData:
    steps: list
    inv: torch.Tensor | None    # [L] row of each token in the concatenated outputs (None: identity)


def sibling_batches(layout: Layout, min_fill: float = MIN_FILL) -> list[tuple[int, ...]]:
    """Non-root segments grouped into batches of siblings (same ancestors) for one padded call each.

    Siblings are sorted by length and cut greedily so that real tokens fill at least ``min_fill``
    of each padded batch: one call instead of G saves the per-call overhead that dominates short
    responses, while the padding never costs more than a third extra. Batches of one included.
    """
    by_anc: dict[tuple, list[int]] = {}
    for s, anc in enumerate(layout.ancestors):
        if anc:
            by_anc.setdefault(anc, []).append(s)
    batches = []
    for segs in by_anc.values():
        segs = sorted(segs, key=lambda x: -layout.lengths[x])
        cur: list[int] = []
        for x in segs:
            n_max = layout.lengths[cur[0]] if cur else layout.lengths[x]
            total = sum(layout.lengths[y] for y in cur) + layout.lengths[x]
            if cur and total < min_fill * n_max * (len(cur) + 1):
                batches.append(tuple(cur))
                cur = []
            cur.append(x)
        batches.append(tuple(cur))
    return batches


def _ancestor_tokens(layout: Layout, s: int) -> torch.Tensor:
    """LongTensor [offset of s]: packed indices of the tokens of ``s``'s ancestors, root first."""
    anc = layout.ancestors[s]
    if not anc:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(layout.starts[a], layout.starts[a] + layout.lengths[a]) for a in anc])


def _batch(layout: Layout, segs: tuple[int, ...], pos: torch.Tensor, pattern, with_pos: bool,
           device: torch.device) -> tuple[_Batch, torch.Tensor, torch.Tensor]:
    """The batch of ``segs`` (equal ancestor counts) and, per real query token, its output row or -1 if dead."""
    lens = torch.tensor([layout.lengths[s] for s in segs])
    starts = torch.tensor([layout.starts[s] for s in segs])
    G, n = len(segs), int(lens.max())
    anc = torch.stack([_ancestor_tokens(layout, s) for s in segs])                 # [G, a]
    a = anc.shape[1]
    rows = torch.arange(n)
    real = rows[None, :] < lens[:, None]                                          # [G, n]
    own = torch.where(real, starts[:, None] + rows[None, :], starts[:, None])     # pad rows read a real token
    qidx = own.reshape(-1)
    kidx = torch.cat([anc, own], dim=1)                                           # [G, m]
    m = a + n
    mask = torch.ones(G, n, m, dtype=torch.bool)
    mask[:, :, a:] = torch.ones(n, n, dtype=torch.bool).tril()[None] & real[:, None, :]
    q_pos = kv_pos = None
    if pattern is not None or with_pos:
        q_pos, kv_pos = pos[own], pos[kidx]                                       # [G, n], [G, m]
        if pattern is not None:  # evaluated where the kernel runs (a user pattern may hold device tensors)
            p = pattern.to_device(device)
            mask &= p(q_pos.to(device)[:, :, None], kv_pos.to(device)[:, None, :]).expand(G, n, m).cpu()
    live = mask.any(-1) & real                                                    # [G, n]
    mask[..., 0] |= ~live  # dead and padded rows read key 0 (never an empty softmax); never used
    out_row = torch.where(live, torch.arange(G * n).view(G, n), -1)
    tokens = own[real]                                                            # physical, row-major
    b = _Batch(G, n, m, qidx.to(device), kidx.reshape(-1).to(device), mask[:, None].to(device),
               None if not with_pos else q_pos.view(G, 1, 1, n, 1).to(device),
               None if not with_pos else kv_pos.view(G, 1, 1, 1, m).to(device))
    return b, tokens, out_row[real]


def plan_sdpa(layout: Layout, pattern, score_mod: ScoreMod | None, device: torch.device) -> SdpaPlanData:
    """Build the steps and the output index (CPU work, then one copy of each index to ``device``)."""
    pos = layout.token_tensors()["pos"]
    steps, tok_parts, row_parts = [], [], []
    base = 0
    batches = sibling_batches(layout)
    if pattern is None and score_mod is None:
        by_len: dict[int, list[int]] = {}
        for r in layout.roots:
            by_len.setdefault(layout.lengths[r], []).append(r)
        for n, roots in by_len.items():
            toks = torch.cat([torch.arange(layout.starts[r], layout.starts[r] + n) for r in roots])
            if len(roots) == 1:
                steps.append(_Causal(layout.starts[roots[0]], n))
            else:  # one causal call over the gathered roots
                idx = toks.to(device)
                steps.append(_Batch(len(roots), n, n, idx, idx, None, None, None))
            tok_parts.append(toks)
            row_parts.append(torch.arange(base, base + toks.numel()))
            base += toks.numel()
    else:
        batches = [(r,) for r in layout.roots] + batches
    merged: dict[tuple[int, int], list[int]] = {}  # batches of one shape (a, n) run as one call
    for segs in batches:
        key = (layout.offsets[segs[0]], max(layout.lengths[s] for s in segs))
        merged.setdefault(key, []).extend(segs)
    for segs in merged.values():
        b, toks, rows = _batch(layout, segs, pos, pattern, score_mod is not None, device)
        steps.append(b)
        tok_parts.append(toks)
        row_parts.append(torch.where(rows >= 0, rows + base, -1))
        base += b.G * b.n
    L = layout.num_tokens
    inv = torch.empty(L, dtype=torch.long)
    rows = torch.cat(row_parts)
    inv[torch.cat(tok_parts)] = torch.where(rows >= 0, rows, base)  # base: the appended zero row
    identity = len(steps) == 1 and isinstance(steps[0], _Causal)
    return SdpaPlanData(steps, None if identity else inv.to(device))


class SdpaBackend(Backend):
    """Exact on any device, forward and backward."""

    name = "sdpa"
    exact_note = "per-segment F.scaled_dot_product_attention over allowed keys only"

    def prepare(self, layout, pattern, score_mod, device, **_) -> Plan:
        smod = score_mod.to(device) if score_mod is not None else None
        return Plan(self.name, layout, pattern, smod, device, plan_sdpa(layout, pattern, smod, device))

    # Eager under a whole-model torch.compile: torch 2.6's inductor (CPU) computed wrong gradients
    # for this gather / scatter pattern (shared ancestor rows read by several batch rows), silently;
    # the aten SDPA kernels gain nothing from tracing anyway.
    @torch.compiler.disable
    def run(self, plan, q, k, v, scale):
        d: SdpaPlanData = plan.data
        gqa = q.shape[1] != k.shape[1]
        Hq, D, Hkv = q.shape[1], q.shape[3], k.shape[1]
        qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))  # [L, H, D] views
        outs = []
        for st in d.steps:
            if isinstance(st, _Causal):
                sl = slice(st.start, st.start + st.n)
                o = F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True,
                                                   scale=scale, enable_gqa=gqa)    # [1, Hq, n, D]
                outs.append(o[0].transpose(0, 1))                                  # [n, Hq, D]
                continue
            G, n, m = st.G, st.n, st.m
            qb = qt.index_select(0, st.qidx).view(G, n, Hq, D).transpose(1, 2)     # [G, Hq, n, D]
            kb = kt.index_select(0, st.kidx).view(G, m, Hkv, D).transpose(1, 2)    # [G, Hkv, m, D]
            vb = vt.index_select(0, st.kidx).view(G, m, Hkv, D).transpose(1, 2)
            if st.mask is None:
                o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
            elif plan.score_mod is not None:
                o = _math_attention(qb, kb, vb, st.mask, plan.score_mod, scale, st.q_pos, st.kv_pos)
            else:
                o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=st.mask, scale=scale, enable_gqa=gqa)
            outs.append(o.transpose(1, 2).reshape(G * n, Hq, D))
        if d.inv is None:
            return outs[0].transpose(0, 1)[None]
        outs.append(q.new_zeros(1, Hq, D))
        out = torch.cat(outs).index_select(0, d.inv)                               # [L, Hq, D]
        return out.transpose(0, 1)[None]                                           # [1, Hq, L, D]


def _broadcast_scores(out, scores: torch.Tensor) -> torch.Tensor:
    """A score_mod's result as the full score tensor: FlexAttention applies a score_mod per element, so
    a constant (0-d or Python number) or a result that depends on fewer indices broadcasts."""
    out = torch.as_tensor(out, device=scores.device)
    if out.shape == scores.shape:
        return out
    try:
        return torch.broadcast_to(out.to(scores.dtype), scores.shape)
    except RuntimeError:
        raise ValueError(f"score_mod returned shape {tuple(out.shape)}, which does not broadcast to one value per "
                         "(head, query, key) score: return a value computed from its arguments (e.g. score + bias) "
                         "or a constant") from None


def _math_attention(q, k, v, mask, smod: ScoreMod, scale, q_pos, kv_pos):
    """Explicit attention with a score_mod.

    q [G, Hq, n, D], k/v [G, Hkv, m, D], mask [G, 1, n, m], q_pos [G, 1, 1, n, 1], kv_pos
    [G, 1, 1, 1, m] -> [G, Hq, n, D].
    """
    G, hq, n, d = q.shape
    hkv, m = k.shape[1], k.shape[2]
    g = hq // hkv
    q5 = q.reshape(G, hkv, g, n, d)
    scores = torch.matmul(q5, k[:, :, None].transpose(-1, -2)) * scale  # [G, Hkv, g, n, m]
    h = torch.arange(hq, device=q.device).view(1, hkv, g, 1, 1)  # head i uses kv head i // g
    b = torch.zeros(1, 1, 1, 1, 1, dtype=torch.long, device=q.device)
    scores = _broadcast_scores(smod(scores, b, h, q_pos, kv_pos), scores)
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    # softmax in at least float32, as transformers' eager attention does
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return torch.matmul(probs, v[:, :, None]).reshape(G, hq, n, d)


SDPA = SdpaBackend()
