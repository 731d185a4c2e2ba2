"""The ``lse`` backend's plan: a layout cut into mask-free attention parts.

A query token of segment ``s`` sees two kinds of keys: every token of ``s``'s ancestors (no mask
at all) and the tokens of ``s`` itself causally. The plan makes each kind a list of *parts* -- one
fused kernel call each -- whose outputs merge exactly by their log-sum-exps:

- **own** parts (every segment has one): segments of similar length of one tree batched as ``G`` rows padded to
  ``n`` (padding at the end, so a causal real row never reads a padded key), one causal call; cut
  greedily so that real causal pairs fill >= 75 % of the padded ones. A lone segment is a slice.
- **ancestor** parts (every non-root segment has one): the queries of all siblings (same ancestors)
  stacked as one block of ``sum(R_i)`` rows against the ancestors' ``a`` keys once, one unmasked
  call; parts of one shape ``(n, a)`` across sibling sets of one tree run as one batched call.

No part spans two trees of the forest: a tree's parts -- their padding, their batch size, which
kernel path a shape takes -- are a function of that tree alone, so its numbers are bitwise the same
whatever trees share the row, in whatever order (the batch-invariance of ``docs/batch-invariance.md``).
Batching across trees would save calls on rows of many small groups, at that price.

A pattern (window, chunks, sinks, user pattern) is evaluated on virtual positions at plan time,
part by part: a part where it allows every needed pair stays mask-free, a part where it allows none
is dropped, and only a part that it cuts keeps an exact mask ``[G, 1, n, m]`` (0 / -inf bias).

Indices (all LongTensors on the plan's device): ``qidx [G * n]`` physical query rows (padded rows
read a real token of their segment), ``kidx [G * m]`` physical key rows (None for own parts: the
query rows), ``tokens [N]`` the physical token of each real row and ``rows [N]`` its row in the
flattened ``G * n`` (None when every row is real, in order). ``q_start`` / ``k_start``: set when
the rows are one contiguous range of the packed row: the kernel reads a (strided) view, no gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layout import Layout

__all__ = ["Part", "plan_parts", "MIN_FILL"]

MIN_FILL = 0.75
WASTE_PAIRS = 2048   # padded causal pairs a segment may add to a batch (about one call's fixed cost)
CHUNK = 256          # own parts longer than 2 * CHUNK are cut into a chain of chunks (see chain_chunks)


@dataclass
class Part:
    """One fused call: ``G`` query blocks of ``n`` rows against ``m`` keys each (see the module docstring)."""

    G: int
    n: int
    m: int
    causal: bool
    own: bool                           # every token it covers is written, not merged (own parts come first)
    qidx: torch.Tensor                  # [G * n]
    kidx: torch.Tensor | None           # [G * m]; None: the query rows (own parts)
    tokens: torch.Tensor                # [N]
    rows: torch.Tensor | None           # [N] or None (identity)
    pad: torch.Tensor | None            # [G * n - N] padded rows, or None
    q_start: int | None = None
    k_start: int | None = None
    mask: torch.Tensor | None = None    # [G, 1, n, m] bool (allowed), or None: mask-free
    dead: torch.Tensor | None = None    # rows (of G * n) with no allowed key in this part
    _bias: dict = field(default_factory=dict, repr=False)

    def bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive mask ``[G, 1, n, m]`` (0 allowed, -inf not) in ``dtype``, built once per dtype."""
        if self.mask is None:
            return None
        if dtype not in self._bias:
            b = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._bias[dtype] = b.masked_fill_(~self.mask, float("-inf"))
        return self._bias[dtype]


def _pairs(n: int) -> int:
    return n * (n + 1) // 2


def length_batches(segs: list[int], lengths, waste: int = WASTE_PAIRS) -> list[list[int]]:
    """``segs`` sorted by length and cut so that padding a segment to its batch's longest adds <= ``waste`` pairs.

    One causal call per batch instead of one per segment saves the fixed cost per call that dominates
    short segments; the padded rows compute pairs nobody needs, so long segments only batch with
    segments of (almost) their own length.
    """
    out: list[list[int]] = []
    cur: list[int] = []
    for s in sorted(segs, key=lambda x: -lengths[x]):
        if cur and _pairs(lengths[cur[0]]) - _pairs(lengths[s]) > waste:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    return out


def chain_chunks(layout: Layout, chunk: int = CHUNK) -> Layout:
    """The same attention as ``layout`` with every segment longer than ``2 * chunk`` cut into a chain.

    A segment of ``n`` tokens becomes ``n // chunk`` consecutive segments of ``chunk`` tokens after one
    of ``n % chunk`` (if any), each the parent of the next (the original children hang off the last): token for token the same
    keys, so the same attention. Why: torch's fused causal CPU kernel skips the upper triangle only
    coarsely and costs about 1.5-2x an unmasked call per needed pair at these lengths; chunked,
    the segment is one batched causal call over equal chunks plus one unmasked call per chunk
    against the chunks before it.
    """
    parents, lengths, last = [], [], {}
    for s, (p, n) in enumerate(zip(layout.parents, layout.lengths)):
        cut = [n] if n <= 2 * chunk else [n % chunk] * (n % chunk > 0) + [chunk] * (n // chunk)
        par = last[p] if p >= 0 else -1
        for c in cut:
            parents.append(par)
            lengths.append(c)
            par = len(parents) - 1
        last[s] = par
    return layout if len(parents) == layout.num_segments else Layout.tree(parents, lengths)


def _start_if_range(idx: torch.Tensor) -> int | None:
    """``idx[0]`` if ``idx`` is ``arange(idx[0], idx[0] + len)``, else None."""
    if idx.numel() == 0:
        return None
    s = int(idx[0])
    return s if torch.equal(idx, torch.arange(s, s + idx.numel())) else None


def _classify(allowed: torch.Tensor, needed: torch.Tensor) -> str:
    """'full' if the pattern allows every needed pair, 'none' if it allows none, else 'cut'."""
    if bool((allowed | ~needed).all()):
        return "full"
    return "cut" if bool((allowed & needed).any()) else "none"


def _own_part(layout: Layout, segs: list[int], masked: bool, pattern, pos, device) -> Part:
    lens = torch.tensor([layout.lengths[s] for s in segs])
    starts = torch.tensor([layout.starts[s] for s in segs])
    G, n = len(segs), int(lens.max())
    r = torch.arange(n)
    real = r[None, :] < lens[:, None]                                           # [G, n]
    idx = torch.where(real, starts[:, None] + r[None, :], starts[:, None])     # padded rows read token 0 of their segment
    qidx = idx.reshape(-1)
    flat_real = real.reshape(-1)
    all_real = bool(flat_real.all())
    mask = dead = None
    if masked:
        allowed = pattern(pos[idx][:, :, None], pos[idx][:, None, :]).expand(G, n, n)   # [G, n, n]
        needed = torch.ones(n, n, dtype=torch.bool).tril()[None] & real[:, None, :] & real[:, :, None]
        mask = allowed & needed
        live = mask.any(-1)
        dead_rows = (~live & real).reshape(-1).nonzero().flatten()
        dead = dead_rows.to(device) if dead_rows.numel() else None
        mask = mask[:, None].to(device)
    q_start = _start_if_range(qidx)          # equal adjacent segments (chunks, siblings): a strided view
    return Part(G, n, n, True, True, qidx.to(device), None, idx[real].to(device),
                None if all_real else flat_real.nonzero().flatten().to(device),
                None if all_real else (~flat_real).nonzero().flatten().to(device),
                q_start=q_start, k_start=q_start, mask=mask, dead=dead)


def _seg_tokens(layout: Layout, segs) -> torch.Tensor:
    if not segs:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(layout.starts[s], layout.starts[s] + layout.lengths[s]) for s in segs])


def _ancestor_part(q_tok: torch.Tensor, k_tok: torch.Tensor, mask: torch.Tensor | None, device) -> Part:
    n, m = q_tok.numel(), k_tok.numel()
    dead = None
    if mask is not None:
        live = mask.any(-1)
        dead_rows = (~live).nonzero().flatten()
        dead = dead_rows.to(device) if dead_rows.numel() else None
        mask = mask[None, None].to(device)
    return Part(1, n, m, False, False, q_tok.to(device), k_tok.to(device), q_tok.to(device), None, None,
                q_start=_start_if_range(q_tok), k_start=_start_if_range(k_tok), mask=mask, dead=dead)


def _batched(parts: list[Part], device) -> Part:
    """Mask-free ancestor parts of one shape ``(n, m)`` as one call of ``G = len(parts)``."""
    if len(parts) == 1:
        return parts[0]
    n, m = parts[0].n, parts[0].m
    qidx, kidx = torch.cat([p.qidx for p in parts]), torch.cat([p.kidx for p in parts])
    return Part(len(parts), n, m, False, False, qidx, kidx, qidx, None, None,
                q_start=_start_if_range(qidx.cpu()), k_start=_start_if_range(kidx.cpu()))


def tree_keys(layout: Layout) -> list[tuple[int, int] | torch.Tensor]:
    """The tokens of each tree of ``layout``'s forest, in row order: ``(start, stop)`` when contiguous, else a
    LongTensor of physical indices (on CPU). What :func:`flexgroup.kernels.lse.centre_keys` averages over."""
    toks: dict[int, list[int]] = {}
    for s, r in enumerate(layout.component):
        toks.setdefault(r, []).append(s)
    out: list[tuple[int, int] | torch.Tensor] = []
    for segs in toks.values():
        idx = _seg_tokens(layout, segs)
        start = _start_if_range(idx)
        out.append((start, start + idx.numel()) if start is not None else idx)
    return out


def plan_parts(layout: Layout, pattern, device: torch.device, chunk: int | None = None,
               queries_from: int = 0) -> list[Part]:
    """The parts of ``layout`` under ``pattern``, tree by tree, each tree's own parts first (see the module docstring).

    ``chunk``: segments longer than twice this are planned as chains of chunks (default ``CHUNK``).
    ``queries_from``: only the segments starting at or after this token get parts (their queries);
    the earlier ones are keys only (a streamed chunk's kept context, :mod:`flexgroup.kernels.kept`).
    Indices stay those of the whole layout.
    """
    layout = chain_chunks(layout, CHUNK if chunk is None else chunk)
    pos = layout.token_tensors()["pos"]
    p = None
    if pattern is not None:  # evaluated where the kernel runs (a user pattern may hold device tensors)
        dev_pattern = pattern.to_device(device)

        def p(q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
            return dev_pattern(q_pos.to(device), kv_pos.to(device)).cpu()
    trees: dict[int, list[int]] = {}
    for s in range(layout.num_segments):
        if layout.starts[s] >= queries_from:
            trees.setdefault(layout.component[s], []).append(s)
    return [part for queries in trees.values() for part in _tree_parts(layout, queries, p, pos, device)]


def _tree_parts(layout: Layout, queries: list[int], p, pos: torch.Tensor, device) -> list[Part]:
    """Own parts, then ancestor parts, of the query segments ``queries`` of one tree."""
    own_full, own_cut = [], []
    for s in queries:
        if p is None:
            own_full.append(s)
            continue
        t = _seg_tokens(layout, [s])
        kind = _classify(p(pos[t][:, None], pos[t][None, :]), torch.ones(t.numel(), t.numel(), dtype=torch.bool).tril())
        {"full": own_full, "cut": own_cut, "none": []}[kind].append(s)
    parts = [_own_part(layout, b, False, p, pos, device) for b in length_batches(own_full, layout.lengths)]
    parts += [_own_part(layout, b, True, p, pos, device) for b in length_batches(own_cut, layout.lengths)]
    by_anc: dict[tuple, list[int]] = {}
    for s in queries:
        if layout.ancestors[s]:
            by_anc.setdefault(layout.ancestors[s], []).append(s)
    free: dict[tuple[int, int], list[Part]] = {}
    for anc, segs in by_anc.items():
        k_tok = _seg_tokens(layout, anc)
        if p is None:
            q_tok = _seg_tokens(layout, segs)
            free.setdefault((q_tok.numel(), k_tok.numel()), []).append(_ancestor_part(q_tok, k_tok, None, device))
            continue
        groups: dict[str, list[int]] = {"full": [], "cut": [], "none": []}
        for s in segs:
            t = _seg_tokens(layout, [s])
            groups[_classify(p(pos[t][:, None], pos[k_tok][None, :]), torch.ones((), dtype=torch.bool))].append(s)
        if groups["full"]:
            q_tok = _seg_tokens(layout, groups["full"])
            free.setdefault((q_tok.numel(), k_tok.numel()), []).append(_ancestor_part(q_tok, k_tok, None, device))
        if groups["cut"]:
            q_tok = _seg_tokens(layout, groups["cut"])
            allowed = p(pos[q_tok][:, None], pos[k_tok][None, :]).expand(q_tok.numel(), k_tok.numel())
            keep = allowed.any(0)          # keys no query may see (e.g. behind every window) are left out
            kt, allowed = k_tok[keep], allowed[:, keep]
            parts.append(_ancestor_part(q_tok, kt, None if bool(allowed.all()) else allowed.clone(), device))
    parts += [_batched(same, device) for same in free.values()]
    return parts
