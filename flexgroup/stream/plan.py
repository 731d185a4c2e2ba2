"""The schedule of a streamed batch: which tokens run in which forward, and what each forward keeps.

:func:`plan_stream` takes sequences (a token-level prefix trie, :mod:`flexgroup.layout.trie`) and a token
budget. Trees that fit the budget are packed into rows first-fit (:func:`~flexgroup.layout.trie.plan_micro_batches`),
one ordinary packed forward each. The other trees are *streamed*:

- their segments are visited in pre-order. A subtree that fits the budget runs whole, in the current
  chunk if that holds whole subtrees only and has room, else in a fresh one. A larger subtree's root
  segment -- whose keys and values later chunks read -- joins the current chunk only if that holds
  nothing but its ancestors (else it starts a fresh one), cut into *pieces* where it overflows (the
  next piece continuing in a fresh chunk), and its children are visited in turn -- unless the rest
  of its subtree fits beside its last piece, alone in a chunk: then it runs there whole. So every chunk holds
  at most ``budget`` tokens, each token runs in exactly one forward, and a chunk whose graph must wait
  for later chunks (below) holds no whole subtree whose graph could go at once;
- a chunk's *context* is every ancestor piece of its pieces that ran in an earlier chunk: their
  keys and values are kept from that earlier forward (:mod:`flexgroup.stream.chunk_carrier`);
- a token's log-prob is read from the logits of its predecessor on the path (the previous token,
  or the parent segment's last token after a branch), so it is *produced* by the chunk holding the
  predecessor; a sequence's row ``lp [T]`` is assembled in the chunk holding its last token, from
  the log-probs its own chunk produced and those kept from earlier chunks.

A chunk whose keys, values or log-probs later chunks read is *pending*: its backward runs once every
reader has run its own (:attr:`ChunkPlan.readers`), with the gradients they accumulated.

Pure Python and PyTorch (data layer): no transformers import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layout import Layout
from ..layout.trie import PrefixTrie, build_trie, plan_micro_batches

__all__ = ["StreamPlan", "ChunkPlan", "plan_stream"]

Tensor = torch.Tensor


@dataclass
class ChunkPlan:
    """One streamed forward.

    Attributes:
        pieces: global piece ids run here, in row order.
        tokens: LongTensor [Q]: the trie-row index of each token run here (row order).
        layout: Layout over ``context pieces + pieces`` (the kept context first); its virtual
            positions are the tokens' true positions.
        n_context: tokens of kept context in ``layout``.
        context: global piece ids of the context, in ``layout`` order.
        row_layout: Layout over the chunk's own pieces only (parents outside the chunk cut): what the
            model's per-forward checks see; ``row_layout.num_tokens == Q``.
        positions: LongTensor [Q], true virtual positions.
        external: per own piece, its parent piece when that ran in an earlier chunk, else -1 (a hybrid
            mixer starts such a piece from the parent's kept recurrent and conv state).
        keep: ``(piece, local start, length)`` of this chunk's pieces that later chunks read as context.
        logit_rows: LongTensor [K], sorted local rows whose logits this chunk needs.
        produced: LongTensor [P]: trie-row token whose log-prob this chunk produces (sorted);
        produced_rows: LongTensor [P]: index into ``logit_rows`` of each one's predecessor.
        sequences: LongTensor [n]: input sequences whose last token runs here (their loss is computed here).
        sources: chunk ids whose produced log-probs the rows of ``sequences`` read (sorted; may include self).
        gather: LongTensor [M]: per masked entry, index into ``cat(produced of sources)``;
        flat: LongTensor [M]: its place in the ``[n * T]`` row block.
        readers: later chunks that read this chunk's keys/values or log-probs.
    """

    pieces: list[int]
    tokens: Tensor
    layout: Layout
    n_context: int
    context: list[int]
    row_layout: Layout
    positions: Tensor
    external: list[int] = field(default_factory=list)
    keep: list[tuple[int, int, int]] = field(default_factory=list)
    logit_rows: Tensor | None = None
    produced: Tensor | None = None
    produced_rows: Tensor | None = None
    sequences: Tensor | None = None
    sources: list[int] = field(default_factory=list)
    gather: Tensor | None = None
    flat: Tensor | None = None
    readers: set[int] = field(default_factory=set)


@dataclass
class StreamPlan:
    """What :func:`plan_stream` returns.

    Attributes:
        trie: the prefix trie of all sequences; ``input_ids`` LongTensor [L] its packed row.
        rows: per packed forward, the input sequences it holds (trees that fit the budget).
        chunks: the streamed forwards, in run order (ancestors first).
        width: ``T``, the longest sequence.
    """

    trie: PrefixTrie
    input_ids: Tensor
    rows: list[list[int]]
    chunks: list[ChunkPlan]
    width: int


def _place(layout: Layout, budget: int, trees: list[int]) -> tuple[list[tuple[int, int, int]], list[list[int]]]:
    """Pieces ``(segment, start, length)`` and chunks (lists of piece ids) for the streamed ``trees`` (roots)."""
    sub = list(layout.lengths)             # tokens of each segment's subtree
    nseg = [1] * layout.num_segments       # segments of each subtree (contiguous: pre-order)
    for s in reversed(range(layout.num_segments)):
        if layout.parents[s] >= 0:
            sub[layout.parents[s]] += sub[s]
            nseg[layout.parents[s]] += nseg[s]
    pieces: list[tuple[int, int, int]] = []
    chunks: list[list[int]] = [[]]
    room = [budget]
    shared = [False]        # the current chunk holds pieces that later chunks read (its graph is kept)
    segs: set[int] = set()  # the current chunk's segments

    def new_chunk(reads_later: bool):
        if chunks[-1]:
            chunks.append([])
        room[0], shared[0] = budget, reads_later
        segs.clear()

    def add(seg, start, n):
        chunks[-1].append(len(pieces))
        pieces.append((seg, start, n))
        room[0] -= n
        segs.add(seg)

    def whole(s):  # pre-order: the subtree is segments s .. s + nseg[s] - 1
        for t in range(s, s + nseg[s]):
            add(t, 0, layout.lengths[t])

    stack = list(reversed(trees))
    while stack:
        s = stack.pop()
        if sub[s] <= budget:  # a whole subtree: never beside pieces later chunks read, so its graph goes at once
            if shared[0] or sub[s] > room[0]:
                new_chunk(False)
            whole(s)
            continue
        # a segment whose subtree does not fit: later chunks read its keys and values. It joins the current
        # chunk only if that holds nothing but its ancestors (whose graphs are kept at least as long)
        if not shared[0] or not segs <= set(layout.ancestors[s]) or room[0] == 0:
            new_chunk(True)
        start, n, rest = 0, layout.lengths[s], sub[s]
        while n:
            if room[0] == 0:
                new_chunk(True)
            if segs <= {s} and rest <= room[0]:  # the rest of the subtree fits beside s alone: nothing here
                shared[0] = False               # is read later, so it runs here whole
                add(s, start, n)
                for t in range(s + 1, s + nseg[s]):
                    add(t, 0, layout.lengths[t])
                break
            take = min(room[0], n)
            add(s, start, take)
            start, n, rest = start + take, n - take, rest - take
        else:
            stack.extend(reversed(layout.children[s]))
    return pieces, [c for c in chunks if c]


def plan_stream(sequences: list[Tensor], loss_masks: list[Tensor], budget: int, *, keys: list[list] | None = None,
                pack_rows: bool = True) -> StreamPlan:
    """The schedule of ``sequences`` (checked 1-D id tensors) with ``loss_masks`` under ``budget`` tokens.

    ``keys``: per sequence, the trie key of each token (default its id; a vision-language tree keys a
    placeholder by its image too, :mod:`flexgroup.stream.vision`). ``pack_rows=False``: every tree is
    streamed as chunks (a tree that fits runs whole in one chunk), none as a packed ``GroupedBatch`` row.
    """
    trie = build_trie(keys if keys is not None else [s.tolist() for s in sequences])
    lens = torch.tensor([s.numel() for s in sequences])
    first = lens.cumsum(0) - lens
    input_ids = torch.cat(sequences)[first[trie.source[:, 0]] + trie.source[:, 1]]
    width = int(lens.max())
    members: list[list[int]] = [[] for _ in trie.tree_tokens]
    for k, tr in enumerate(trie.tree_of):
        members[tr].append(k)
    fits = [tr for tr, n in enumerate(trie.tree_tokens) if n <= budget and pack_rows]
    packed = plan_micro_batches([trie.tree_tokens[tr] for tr in fits], budget) if fits else []
    rows = [sorted(k for j in row for k in members[fits[j]]) for row in packed]
    big = [tr for tr, n in enumerate(trie.tree_tokens) if n > budget or not pack_rows]
    if not big:
        return StreamPlan(trie, input_ids, rows, [], width)
    layout = Layout.tree(trie.parents, trie.lengths)
    roots = list(layout.roots)
    pieces, chunk_pieces = _place(layout, budget, [roots[tr] for tr in big])
    return StreamPlan(trie, input_ids, rows, _chunks(layout, pieces, chunk_pieces, trie, sequences, loss_masks,
                                                     [k for tr in big for k in members[tr]], width), width)


def _chunks(layout: Layout, pieces, chunk_pieces, trie: PrefixTrie, sequences, loss_masks, streamed: list[int],
            width: int) -> list[ChunkPlan]:
    """The :class:`ChunkPlan` of each chunk (context, kept pieces, log-prob bookkeeping, readers)."""
    n_pieces = len(pieces)
    last_piece: dict[int, int] = {}
    parent = [-1] * n_pieces
    for p, (seg, start, n) in enumerate(pieces):
        parent[p] = p - 1 if start > 0 else last_piece.get(layout.parents[seg], -1)
        last_piece[seg] = p
    chunk_of_piece = [0] * n_pieces
    for c, ps in enumerate(chunk_pieces):
        for p in ps:
            chunk_of_piece[p] = c
    L = layout.num_tokens
    chunk_of_token = torch.full((L,), -1, dtype=torch.long)
    local_of_token = torch.full((L,), -1, dtype=torch.long)
    pos_all = layout.position_ids
    out: list[ChunkPlan] = []
    for c, ps in enumerate(chunk_pieces):
        toks = torch.cat([torch.arange(layout.starts[seg] + st, layout.starts[seg] + st + n) for seg, st, n in
                          (pieces[p] for p in ps)])
        chunk_of_token[toks] = c
        local_of_token[toks] = torch.arange(toks.numel())
        mine = set(ps)
        ctx: set[int] = set()
        for p in ps:
            a = parent[p]
            while a >= 0 and a not in mine and a not in ctx:
                ctx.add(a)
                a = parent[a]
        context = sorted(ctx)
        order = context + list(ps)
        idx = {p: i for i, p in enumerate(order)}
        lay = Layout.tree([idx[parent[p]] if parent[p] >= 0 else -1 for p in order], [pieces[p][2] for p in order])
        row = Layout.tree([idx[parent[p]] - len(context) if parent[p] in mine else -1 for p in ps],
                          [pieces[p][2] for p in ps])
        out.append(ChunkPlan(list(ps), toks, lay, sum(pieces[p][2] for p in context), context, row, pos_all[toks],
                             [parent[p] if parent[p] >= 0 and parent[p] not in mine else -1 for p in ps]))
        for a in context:
            out[chunk_of_piece[a]].readers.add(c)
    local_start: dict[int, int] = {}
    for ch in out:
        off = 0
        for p in ch.pieces:
            local_start[p] = off
            off += pieces[p][2]
    kept = sorted({a for ch in out for a in ch.context})
    for a in kept:
        out[chunk_of_piece[a]].keep.append((a, local_start[a], pieces[a][2]))
    _logprob_plan(out, trie, loss_masks, streamed, chunk_of_token, local_of_token, width)
    return out


def _logprob_plan(chunks: list[ChunkPlan], trie: PrefixTrie, loss_masks, streamed: list[int],
                  chunk_of_token: Tensor, local_of_token: Tensor, width: int) -> None:
    """Fill each chunk's produced log-probs and the gather of its sequences' rows (see :class:`ChunkPlan`)."""
    ends: dict[int, list[int]] = {}
    for k in streamed:
        ends.setdefault(int(chunk_of_token[trie.paths[k][-1]]), []).append(k)
    entries = {}
    all_x, all_prod = [], []
    for c, ks in ends.items():
        ks.sort()
        per = []
        for r, k in enumerate(ks):
            path, m = trie.paths[k], loss_masks[k]
            t = torch.nonzero(m)[:, 0]
            x, pred = path[t], path[t - 1]
            prod = chunk_of_token[pred]
            per.append((r * width + t, x, prod))
            all_x.append(x)
            all_prod.append(prod)
        entries[c] = per
    all_x, all_prod = torch.cat(all_x), torch.cat(all_prod)
    pred = _predecessors(trie)
    for c, ch in enumerate(chunks):
        produced = torch.unique(all_x[all_prod == c])  # sorted
        ch.produced = produced
        pred_local = local_of_token[pred[produced]]
        ch.logit_rows = torch.unique(pred_local)
        ch.produced_rows = torch.searchsorted(ch.logit_rows, pred_local)
    for c, per in entries.items():
        ch = chunks[c]
        ch.sequences = torch.tensor(ends[c], dtype=torch.long)
        flat = torch.cat([f for f, _, _ in per])
        x = torch.cat([xx for _, xx, _ in per])
        prod = torch.cat([p for _, _, p in per])
        ch.sources = sorted(set(prod.tolist()))
        base, gather = 0, torch.empty_like(x)
        for s in ch.sources:
            sel = prod == s
            gather[sel] = base + torch.searchsorted(chunks[s].produced, x[sel])
            base += chunks[s].produced.numel()
            if s != c:
                chunks[s].readers.add(c)
        ch.gather, ch.flat = gather, flat


def _predecessors(trie: PrefixTrie) -> Tensor:
    """LongTensor [L]: the trie-row index of each token's predecessor on its path (-1 for a first token)."""
    pred = torch.full((trie.num_tokens,), -1, dtype=torch.long)
    for path in trie.paths:
        pred[path[1:]] = path[:-1]
    return pred
