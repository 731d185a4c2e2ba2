"""The ``lse`` backend's plan: a layout cut into mask-free attention parts.

A query token of segment ``s`` sees every token of ``s``'s ancestors and the tokens of ``s`` itself up to
its own: the virtual positions ``0 .. t`` of its path. The plan cuts those keys into *parts* -- one fused
kernel call each -- whose outputs merge exactly by their log-sum-exps. Two plans:

- **the grid** (no pattern; :func:`grid_parts`): keys are cut at multiples of ``CHUNK`` virtual positions,
  and of ``SUB_CELL`` inside a cell (and of coarser multiples), whatever the segments. A query's own
  sub-cell runs causally, the part of its cell before that and its path before its cell unmasked,
  merged in order (a few parts a query). Every part a query's row runs in,
  its place in the call and its merge order are then functions of its own path, so its numbers are
  bitwise the same in any trie (other groups, a shared system prefix, some of its group's responses, a
  streamed chunk: the batch-invariance of ``docs/batch-invariance.md``);
- **the segment plan** (a pattern: window, chunks, sinks, user pattern): parts follow the segments.
  *Own* parts: segments of similar length of one tree batched as ``G`` rows padded to ``n`` (padding at
  the end, so a causal real row never reads a padded key), one causal call, cut greedily so that real
  causal pairs fill >= 75 % of the padded ones. *Ancestor* parts: the queries of all siblings (same
  ancestors) stacked as one block of ``sum(R_i)`` rows against the ancestors' ``a`` keys once, one
  unmasked call; parts of one shape across sibling sets of one tree run as one batched call. No part
  spans two trees, so a tree's numbers do not depend on the other trees of the row; they do depend on
  the tree's own segments. The pattern is evaluated on virtual positions at plan time, part by part: a
  part where it allows every needed pair stays mask-free, a part where it allows none is dropped, and
  only a part that it cuts keeps an exact mask ``[G, 1, n, m]`` (0 / -inf bias).

Indices (all LongTensors on the plan's device): ``qidx [G * n]`` physical query rows (padded rows
read a real token), ``kidx [G * m]`` physical key rows (None for own parts of the segment plan: the
query rows), ``tokens [N]`` the physical token of each row that the part writes or merges and ``rows [N]``
its row in the flattened ``G * n`` (None when every row is one, in order). ``q_start`` / ``k_start``: set
when the rows are one contiguous range of the packed row: the kernel reads a (strided) view, no gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layout import Layout

__all__ = ["Part", "plan_parts", "grid_parts", "root_tokens", "MIN_FILL"]

MIN_FILL = 0.75
WASTE_PAIRS = 2048   # padded causal pairs a segment may add to a batch (about one call's fixed cost)
CHUNK = 256          # the grid's cell (grid_parts); under a pattern, segments over 2 * CHUNK become chains (chain_chunks)


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


def root_tokens(layout: Layout) -> torch.Tensor:
    """LongTensor ``[L]`` (CPU): for each token, the physical index of its tree's first token -- the key that
    :func:`flexgroup.kernels.lse.centre_keys` subtracts (every path of a tree starts with that token)."""
    first = torch.tensor([layout.starts[r] for r in layout.component], dtype=torch.long)
    return torch.repeat_interleave(first, torch.tensor(layout.lengths, dtype=torch.long), output_size=layout.num_tokens)


def plan_parts(layout: Layout, pattern, device: torch.device, chunk: int | None = None,
               queries_from: int = 0) -> list[Part]:
    """The parts of ``layout`` under ``pattern`` (see the module docstring): without a pattern the grid
    (:func:`grid_parts`), else the segment plan, tree by tree, each tree's own parts first.

    ``chunk``: the grid's cell; under a pattern, segments longer than twice this are planned as chains
    of chunks (default ``CHUNK``).
    ``queries_from``: only the segments starting at or after this token get parts (their queries);
    the earlier ones are keys only (a streamed chunk's kept context, :mod:`flexgroup.kernels.kept`).
    Indices stay those of the whole layout.
    """
    if pattern is None:
        return grid_parts(layout, device, chunk, queries_from)
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


# ---------------------------------------------------------------- the grid plan (no pattern)
QUERY_ROWS = 8   # a grid call's query rows are padded to a multiple of this (see grid_parts)
SUB_CELL = 32    # the grid's inner cell: a query's own cell of CHUNK is cut again at multiples of this
LEVEL_FAN = 8    # the grid's outer cells: CHUNK * 8, CHUNK * 64, ... (as far as the row's positions reach)


def _subtree_segments(layout: Layout) -> list[list[int]]:
    """Each segment's descendants (itself excluded), in row order."""
    tin, tout = layout.euler_intervals
    order = sorted(range(layout.num_segments), key=lambda s: tin[s])
    return [sorted(order[tin[s] + 1:tout[s]]) for s in range(layout.num_segments)]


def _path_tokens(layout: Layout, s: int, lo: int, hi: int) -> torch.Tensor:
    """Physical tokens at virtual positions ``[lo, hi)`` of the path ending in segment ``s`` (``hi`` within ``s``)."""
    pieces = []
    for a in (s, *reversed(layout.ancestors[s])):
        off, n, start = layout.offsets[a], layout.lengths[a], layout.starts[a]
        a_lo, a_hi = max(lo, off), min(hi, off + n)
        if a_lo < a_hi:
            pieces.append(torch.arange(start + a_lo - off, start + a_hi - off))
        if off <= lo:
            break
    return torch.cat(pieces[::-1])


def _padded_rows(tok: torch.Tensor, n: int) -> torch.Tensor:
    """``tok [k]`` followed by ``n - k`` copies of ``tok[0]``."""
    return torch.cat([tok, tok[:1].expand(n - tok.numel())])


def _nodes(layout: Layout, C: int):
    """Every node of the grid of cell ``C``: ``(s, c, lo, hi)`` -- the path ending in segment ``s`` at virtual
    positions ``[lo, hi)`` of cell ``c``, for each segment that ends the cell on its path (it reaches the
    cell's end, or is a leaf ending inside it)."""
    for s in range(layout.num_segments):
        off, end = layout.offsets[s], layout.offsets[s] + layout.lengths[s]
        for c in range(off // C, (end - 1) // C + 1):
            lo, hi = c * C, min((c + 1) * C, end)
            if hi == (c + 1) * C or not layout.children[s]:
                yield s, c, lo, hi


def _queries_after(layout: Layout, desc: list[list[int]], s: int, hi: int, horizon: int | None) -> torch.Tensor:
    """Physical tokens at virtual positions ``[hi, horizon)`` (no bound: None) on the paths through segment ``s``
    (which holds position ``hi - 1``): the rest of ``s``, then its descendants."""
    out = []
    for d in (s, *desc[s]):
        off, n = layout.offsets[d], layout.lengths[d]
        lo_d, hi_d = max(hi, off), off + n if horizon is None else min(off + n, horizon)
        if lo_d < hi_d:
            out.append(torch.arange(layout.starts[d] + lo_d - off, layout.starts[d] + hi_d - off))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


def grid_parts(layout: Layout, device: torch.device, chunk: int | None = None, queries_from: int = 0) -> list[Part]:
    """Parts that cut every query's keys at the same virtual positions, whatever the layout around its path.

    The keys of a query at virtual position ``t`` are the tokens at positions ``0 .. t`` of its path.
    They are cut on two grids: *cells* ``[cC, (c + 1)C)`` of ``C = chunk``, and the *sub-cells* of
    ``S = SUB_CELL`` tokens inside each cell (one grid when ``C`` is not a larger multiple of ``S``).
    The tokens of a path in a range of positions are a *node*; paths that share them share the node.
    A query in sub-cell ``j`` of cell ``c`` attends to

    - its own sub-cell, causally: one row of a causal square ``[S, S]`` of the node's tokens then
      padding (every node of the row in one call ``[G, S, S]``; each query written once, from the
      first node that holds it) -- written first;
    - the ``jS`` tokens of its cell before its sub-cell, unmasked: one call per node ``[cC, cC + jS)``,
      the queries every token of sub-cell ``j`` on a path through it;
    - the tokens of its path before its cell, unmasked, likewise cut on coarser grids of
      ``C * LEVEL_FAN ** k`` positions (as far as the row's positions reach): for each, one call per
      node from the start of the query's coarse cell to the start of its finer cell, and one call per
      node ``[0, start of its coarsest cell)`` -- merged in that order, finest first: a few parts per
      query whatever its position (3 up to ``8C`` positions), and a long shared prefix gathered once
      for all its branches. Query rows are padded to a multiple of ``QUERY_ROWS``; nodes of one level,
      place and padded row count batch into one call.

    So the keys of each part, the shape of each call a query's row runs in, its place in a causal
    square and the order of its merges are functions of the query's path alone: its numbers do not
    change when the trie around the path does (other groups, a system prefix shared with them or
    not, the group's other responses, a streamed chunk's boundary). Two properties of the fused CPU
    kernel make a row independent of the *other* rows of its call: its batch entries are independent,
    and a query row's result does not depend on the rows around it when its block of rows holds at
    least 3 (``tests/kernels/test_grid_plan.py`` checks both on this torch). Two grids: the causal
    square repeats a node's shared head (a prompt's last tokens) once per branch, so its size bounds
    that waste, while few large cells keep the number of calls and merges low on long paths.

    ``queries_from``: only tokens at or after it are queries (a streamed chunk's kept context is keys
    only); a node's earlier rows read a query token as a stand-in (their outputs are dropped).
    """
    C = CHUNK if chunk is None else chunk
    S = SUB_CELL if C > SUB_CELL and C % SUB_CELL == 0 else C
    offs, lens = layout.offsets, layout.lengths
    desc = _subtree_segments(layout)
    diag: list[tuple] = []                    # [(q [S], k [S], rows written, their tokens)]
    written: set[tuple[int, int]] = set()     # (segment, sub-cell) pieces already written by a node
    full: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}   # (level, cell, M) -> [(q, k)]
    for s, c, lo, hi in _nodes(layout, S):
        node = _path_tokens(layout, s, lo, hi)
        new_rows = []                         # the pieces of this node not yet written by another
        for a in (s, *reversed(layout.ancestors[s])):
            if offs[a] + lens[a] <= lo:
                break
            if (a, c) not in written:
                written.add((a, c))
                new_rows.append(torch.arange(max(lo, offs[a]) - lo, min(hi, offs[a] + lens[a]) - lo))
        rows = torch.cat(new_rows).sort().values if new_rows else torch.empty(0, dtype=torch.long)
        rows = rows[node[rows] >= queries_from]
        if rows.numel():
            stand_in = node[rows[0]]
            q = _padded_rows(torch.where(node >= queries_from, node, stand_in), S)
            diag.append((q, _padded_rows(node, S), rows, node[rows]))
    # the keys before a query's sub-cell: on each level, from the start of its cell of that level up to the start
    # of its cell of the level below; on the top level, from position 0
    levels = [S, C] if S < C else [C]
    while levels[-1] * LEVEL_FAN <= layout.max_position:
        levels.append(levels[-1] * LEVEL_FAN)
    for i, below in enumerate(levels, 1):
        cell = levels[i] if i < len(levels) else None
        for s, c, lo, hi in _nodes(layout, below):
            start = 0 if cell is None else lo // cell * cell
            if hi != lo + below or (cell is not None and hi == start + cell):
                continue                      # not a full cell of the level below, or it ends a cell of this level
            _add_full(full, (i, (hi - start) // below), _path_tokens(layout, s, start, hi),
                      _queries_after(layout, desc, s, hi, hi + below), queries_from)
    parts = [_grid_diag(diag, S, device)] if diag else []
    return parts + [_grid_full(nodes, M, device) for (_, _, M), nodes in sorted(full.items())]


def _add_full(full: dict, key: tuple[int, int], keys: torch.Tensor, queries: torch.Tensor, queries_from: int) -> None:
    queries = queries[queries >= queries_from]
    if queries.numel():
        M = -(-queries.numel() // QUERY_ROWS) * QUERY_ROWS
        full.setdefault((*key, M), []).append((queries, keys))


def _grid_diag(nodes, n: int, device) -> Part:
    """The causal squares ``[G, n, n]`` of ``G`` nodes padded to ``n`` rows (see :func:`grid_parts`)."""
    G = len(nodes)
    qidx, kidx = torch.cat([q for q, _, _, _ in nodes]), torch.cat([k for _, k, _, _ in nodes])
    rows = torch.cat([r + g * n for g, (_, _, r, _) in enumerate(nodes)])
    pad = torch.ones(G * n, dtype=torch.bool)
    pad[rows] = False
    every = torch.equal(rows, torch.arange(G * n))
    same = torch.equal(qidx, kidx)
    return Part(G, n, n, True, True, qidx.to(device), None if same else kidx.to(device),
                torch.cat([t for _, _, _, t in nodes]).to(device),
                None if every else rows.to(device), None if every else pad.nonzero().flatten().to(device),
                q_start=_start_if_range(qidx), k_start=_start_if_range(kidx))


def _grid_full(nodes, M: int, device) -> Part:
    """One unmasked call: ``G`` nodes of one cell, each against its queries padded to ``M`` rows."""
    qidx = torch.cat([_padded_rows(q, M) for q, _ in nodes])
    kidx = torch.cat([k for _, k in nodes])
    m = nodes[0][1].numel()
    real = torch.cat([torch.arange(M) < q.numel() for q, _ in nodes])
    all_real = bool(real.all())
    return Part(len(nodes), M, m, False, False, qidx.to(device), kidx.to(device), qidx[real].to(device),
                None if all_real else real.nonzero().flatten().to(device),
                None if all_real else (~real).nonzero().flatten().to(device),
                q_start=_start_if_range(qidx), k_start=_start_if_range(kidx))
