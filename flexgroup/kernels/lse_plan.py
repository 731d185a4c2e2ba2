"""The ``lse`` backend's plan: a layout cut into mask-free attention parts.

A query token of segment ``s`` sees every token of ``s``'s ancestors and the tokens of ``s`` itself up to
its own: the virtual positions ``0 .. t`` of its path. The plan cuts those keys into *parts* -- one fused
kernel call each -- whose outputs merge exactly by their log-sum-exps (:func:`grid_parts`).

The keys are cut at multiples of ``CHUNK`` virtual positions, of ``SUB_CELL`` inside a cell (and of
coarser multiples), whatever the segments. A query's own sub-cell runs causally, the part of its cell
before that and its path before its cell unmasked, merged in order (a few parts a query). Every part a
query's row runs in, its place in the call and its merge order are then functions of its own path, so
its numbers are bitwise the same in any trie (other groups, a shared system prefix, some of its group's
responses, a streamed chunk: the batch-invariance of ``docs/batch-invariance.md``).

A pattern (window, chunks, sinks, user pattern) is evaluated on virtual positions at plan time, node
by node: a node where it allows every needed pair stays mask-free, one where it allows none is dropped,
and only one that it cuts keeps an exact mask ``[G, 1, n, m]`` (0 / -inf bias); the fused kernel gives
an uncut row the same bits either way, so a pattern keeps the invariance.

Indices (all LongTensors on the plan's device): ``qidx [G * n]`` physical query rows (padded rows
read a real token), ``kidx [G * m]`` physical key rows (None when they are the query rows), ``tokens [N]`` the physical token of each row that the part writes or merges and ``rows [N]``
its row in the flattened ``G * n`` (None when every row is one, in order). ``q_start`` / ``k_start``: set
when the rows are one contiguous range of the packed row: the kernel reads a (strided) view, no gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layout import Layout

__all__ = ["Part", "plan_parts", "grid_parts", "root_tokens"]

CHUNK = 256          # the grid's cell (grid_parts)


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


def _start_if_range(idx: torch.Tensor) -> int | None:
    """``idx[0]`` if ``idx`` is ``arange(idx[0], idx[0] + len)``, else None."""
    if idx.numel() == 0:
        return None
    s = int(idx[0])
    return s if torch.equal(idx, torch.arange(s, s + idx.numel())) else None


def root_tokens(layout: Layout) -> torch.Tensor:
    """LongTensor ``[L]`` (CPU): for each token, the physical index of its tree's first token -- the key that
    :func:`flexgroup.kernels.lse.centre_keys` subtracts (every path of a tree starts with that token)."""
    first = torch.tensor([layout.starts[r] for r in layout.component], dtype=torch.long)
    return torch.repeat_interleave(first, torch.tensor(layout.lengths, dtype=torch.long), output_size=layout.num_tokens)


def plan_parts(layout: Layout, pattern, device: torch.device, chunk: int | None = None,
               queries_from: int = 0) -> list[Part]:
    """The parts of ``layout`` under ``pattern`` (:func:`grid_parts`; see the module docstring).

    ``chunk``: the grid's cell (default ``CHUNK``).
    ``queries_from``: only the segments starting at or after this token get parts (their queries);
    the earlier ones are keys only (a streamed chunk's kept context, :mod:`flexgroup.kernels.kept`).
    Indices stay those of the whole layout.
    """
    p = None
    if pattern is not None:  # evaluated where the kernel runs (a user pattern may hold device tensors)
        dev_pattern = pattern.to_device(device)

        def p(q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
            return dev_pattern(q_pos.to(device), kv_pos.to(device)).cpu()
    return grid_parts(layout, device, chunk, queries_from, p)


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


def grid_parts(layout: Layout, device: torch.device, chunk: int | None = None, queries_from: int = 0,
               pattern=None) -> list[Part]:
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

    ``pattern``: ``(q_pos, kv_pos) -> allowed`` on virtual positions (CPU tensors), or None. A node whose
    needed pairs it all allows runs as without it; one it cuts gets an exact mask ``[n, m]`` (its rows
    with no allowed key are *dead*: output 0, LSE -inf); one it allows nothing is dropped. A row's bits
    do not depend on whether its call is masked: the fused kernel gives a row that no mask cuts the
    same bits with a zero bias as without one (``tests/kernels/test_grid_plan.py``).
    """
    C = CHUNK if chunk is None else chunk
    pos = layout.token_tensors()["pos"] if pattern is not None else None
    S = SUB_CELL if C > SUB_CELL and C % SUB_CELL == 0 else C
    offs, lens = layout.offsets, layout.lengths
    desc = _subtree_segments(layout)
    diag: list[tuple] = []                    # [(q [S], k [S], rows written, their tokens, mask [S, S] or None)]
    written: set[tuple[int, int]] = set()     # (segment, sub-cell) pieces already written by a node
    full: dict[tuple, list[tuple]] = {}       # (level, place, M, masked) -> [(queries, keys, mask or None)]
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
            keys = _padded_rows(node, S)
            mask = None
            if pattern is not None:
                causal = torch.ones(S, S, dtype=torch.bool).tril()
                mask = causal & pattern(pos[keys][:, None], pos[keys][None, :])
                real = node.numel()
                if torch.equal(mask[:real, :real], causal[:real, :real]):
                    mask = None                       # the pattern cuts none of this node's pairs
            diag.append((q, keys, rows, node[rows], mask))
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
                      _queries_after(layout, desc, s, hi, hi + below), queries_from, pattern, pos)
    parts = [_grid_diag([d for d in diag if (d[4] is not None) == cut], S, device) for cut in (False, True)
             if any((d[4] is not None) == cut for d in diag)]
    return parts + [_grid_full(nodes, M, device) for (_, _, M, _), nodes in sorted(full.items())]


def _add_full(full: dict, key: tuple[int, int], keys: torch.Tensor, queries: torch.Tensor, queries_from: int,
              pattern, pos) -> None:
    queries = queries[queries >= queries_from]
    if not queries.numel():
        return
    mask = None
    if pattern is not None:
        mask = pattern(pos[queries][:, None], pos[keys][None, :]).expand(queries.numel(), keys.numel())
        if not bool(mask.any()):
            return                                    # the pattern allows none of these pairs
        mask = None if bool(mask.all()) else mask
    M = -(-queries.numel() // QUERY_ROWS) * QUERY_ROWS
    full.setdefault((*key, M, mask is not None), []).append((queries, keys, mask))


def _grid_diag(nodes, n: int, device) -> Part:
    """The causal squares ``[G, n, n]`` of ``G`` nodes padded to ``n`` rows (see :func:`grid_parts`); masked
    (``[G, 1, n, n]``) where the nodes carry a pattern's mask."""
    G = len(nodes)
    qidx, kidx = torch.cat([d[0] for d in nodes]), torch.cat([d[1] for d in nodes])
    rows = torch.cat([d[2] + g * n for g, d in enumerate(nodes)])
    pad = torch.ones(G * n, dtype=torch.bool)
    pad[rows] = False
    every = torch.equal(rows, torch.arange(G * n))
    same = torch.equal(qidx, kidx)
    mask = dead = None
    if nodes[0][4] is not None:
        allowed = torch.stack([d[4] for d in nodes])                                   # [G, n, n]
        dead_rows = ((~allowed.any(-1)).reshape(-1) & ~pad).nonzero().flatten()      # of the G * n rows
        dead = dead_rows.to(device) if dead_rows.numel() else None
        mask = allowed[:, None].to(device)
    return Part(G, n, n, mask is None, True, qidx.to(device), None if same else kidx.to(device),
                torch.cat([d[3] for d in nodes]).to(device),
                None if every else rows.to(device), None if every else pad.nonzero().flatten().to(device),
                q_start=_start_if_range(qidx), k_start=_start_if_range(kidx), mask=mask, dead=dead)


def _grid_full(nodes, M: int, device) -> Part:
    """One unmasked call: ``G`` nodes of one cell, each against its queries padded to ``M`` rows; masked
    (``[G, 1, M, m]``, padded rows allowed every key) where the nodes carry a pattern's mask."""
    qidx = torch.cat([_padded_rows(q, M) for q, _, _ in nodes])
    kidx = torch.cat([k for _, k, _ in nodes])
    m = nodes[0][1].numel()
    real = torch.cat([torch.arange(M) < q.numel() for q, _, _ in nodes])
    all_real = bool(real.all())
    mask = dead = None
    if nodes[0][2] is not None:
        allowed = torch.ones(len(nodes), M, m, dtype=torch.bool)
        for g, (q, _, a) in enumerate(nodes):
            allowed[g, :q.numel()] = a
        dead_rows = ((~allowed.any(-1)).reshape(-1) & real).nonzero().flatten()       # of the G * M rows
        dead = dead_rows.to(device) if dead_rows.numel() else None
        mask = allowed[:, None].to(device)
    return Part(len(nodes), M, m, False, False, qidx.to(device), kidx.to(device), qidx[real].to(device),
                None if all_real else real.nonzero().flatten().to(device),
                None if all_real else (~real).nonzero().flatten().to(device),
                q_start=_start_if_range(qidx), k_start=_start_if_range(kidx), mask=mask, dead=dead)
