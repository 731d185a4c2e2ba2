"""Token-level prefix tries over many sequences, and token-budget micro-batch plans.

:func:`sorted_lcp` is the one sorted-prefix costing: in lexicographic order a sequence shares with the
trie built from those before it exactly its common prefix with its predecessor, so a set's trie has
``sum(len) - sum(lcp)`` tokens (the planners of scoring, verl and streaming cost and cut rows with it).

:func:`build_trie` merges every identical leading run of tokens across a whole list of sequences
(a system prompt shared by all groups, each group's task prompt, earlier turns shared by tree
rollouts) into one node per distinct prefix, then compresses chains into segments at branch points:
the ``parents`` / ``lengths`` of a :meth:`flexgroup.Layout.tree` forest. Sharing a prefix is exact
for a causal decoder: a token's hidden states depend only on the tokens before it on its own path,
and the layout gives each token exactly that context and its virtual position (its index in the
sequence).

:func:`plan_micro_batches` packs the trees of such a forest into rows under a token budget
(first-fit decreasing; a tree is never split).

Pure Python and PyTorch: no transformers import.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from .checks import is_int

__all__ = ["PrefixTrie", "build_trie", "plan_micro_batches", "plan_rows", "sorted_lcp", "SortedNodes"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class PrefixTrie:
    """A forest of shared prefixes laid out in one packed row (pre-order: every ancestor first).

    Attributes:
        parents, lengths: segment parents (-1 for a root) and lengths, for :meth:`Layout.tree`;
            a segment ends where the trie branches (and where a tree ends).
        paths: one LongTensor ``[n_i]`` per input sequence: the packed-row index of each of its
            tokens, in order (a strict prefix or a duplicate of another sequence reads along the
            same nodes).
        source: LongTensor ``[L, 2]``: for each packed token, ``(sequence, position)`` of its first
            occurrence in the input (its key is ``sequences[s][t]``).
        tree_of: tree index (roots in packed order) of each input sequence.
        tree_tokens: packed tokens of each tree.
    """

    parents: tuple[int, ...]
    lengths: tuple[int, ...]
    paths: tuple[Tensor, ...]
    source: Tensor
    tree_of: tuple[int, ...]
    tree_tokens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """Distinct prefixes = nodes of the trie = length of the packed row."""
        return self.source.shape[0]

    def packed_row(self, sequences: Sequence[Tensor]) -> Tensor:
        """The packed row [L] of the tensors the trie was built from (each packed token's first occurrence)."""
        n = torch.tensor([s.numel() for s in sequences])
        first = n.cumsum(0) - n
        return torch.cat(list(sequences))[first[self.source[:, 0]] + self.source[:, 1]]


def _codes(sequences: Sequence[Sequence[Hashable]]) -> tuple[list[Tensor], list[list]]:
    """Each sequence as a LongTensor [n_i] of key codes (two keys get the same code iff they are equal),
    and as a list of orderable keys (the keys themselves when all are ints, else their codes)."""
    seqs = [s.tolist() if isinstance(s, Tensor) else s if isinstance(s, list) else list(s) for s in sequences]
    try:  # ints (and bools, numpy ints: anything with __index__) convert in C; True == 1 as in a dict
        codes = [torch.frombuffer(array("q", s), dtype=torch.long) if s else torch.zeros(0, dtype=torch.long)
                 for s in seqs]
        return codes, seqs
    except (TypeError, OverflowError):  # other keys: number them by equality, as a dict does
        ids: dict = {}
        lists = [[ids.setdefault(k, len(ids)) for k in s] for s in seqs]
        return [torch.tensor(x, dtype=torch.long) for x in lists], lists


def _lcp(x: Tensor, y: Tensor) -> int:
    m = min(x.numel(), y.numel())
    ne = (x[:m] != y[:m]).nonzero()
    return int(ne[0, 0]) if ne.numel() else m


def _longest_earlier_prefix(codes: list[Tensor], lists: list[list]) -> list[tuple[int, int]]:
    """For each sequence i: ``(h, j)``, the longest prefix ``h`` it shares with an earlier sequence ``j``
    (``j = -1``, ``h = 0`` when none). In lexicographic order, the earlier sequence sharing most is the
    nearest earlier one on the left or on the right (shared prefixes only shrink with distance)."""
    n = len(codes)
    order = sorted(range(n), key=lists.__getitem__)
    near: list[list[int]] = [[] for _ in range(n)]
    for seq in (order, order[::-1]):  # nearest earlier (smaller index) neighbour on each side: a stack
        stack: list[int] = []
        for i in seq:
            while stack and stack[-1] > i:
                stack.pop()
            if stack:
                near[i].append(stack[-1])
            stack.append(i)
    return [max([(_lcp(codes[i], codes[j]), j) for j in near[i]], default=(0, -1), key=lambda hj: hj[0])
            for i in range(n)]


def build_trie(sequences: Sequence[Sequence[Hashable]]) -> PrefixTrie:
    """Token-level prefix trie over ``sequences`` (each a non-empty list of hashable keys, e.g. token ids).

    Two tokens share a node iff the two sequences agree on every key up to and including them.
    Nodes are numbered in pre-order (children in order of first appearance), so each tree, and each
    segment, is contiguous in the packed row, and trees appear in order of first appearance.

    Work is on whole sequences, not tokens: each sequence adds one *run* of new nodes after the longest
    prefix it shares with an earlier one (found by a lexicographic sort); runs are cut into *pieces*
    after every node another run attaches to, and the pieces are laid out depth-first. Python loops
    over sequences and pieces; the per-token work is tensor operations.
    """
    codes, lists = _codes(sequences)
    # node ids in creation order: sequence by sequence, each adding nodes h..n-1 (one run)
    id_paths: list[Tensor] = []
    runs: list[tuple[int, int, int, int, int]] = []  # (sequence, h, first id, length, attach id or -1)
    nxt = 0
    for i, (h, j) in enumerate(_longest_earlier_prefix(codes, lists)):
        n = codes[i].numel()
        shared = id_paths[j][:h] if h else torch.zeros(0, dtype=torch.long)
        id_paths.append(torch.cat([shared, torch.arange(nxt, nxt + n - h)]))
        if n > h:
            runs.append((i, h, nxt, n - h, int(shared[-1]) if h else -1))
            nxt += n - h
    n_nodes = nxt
    attached: dict[int, list[int]] = {}  # node id -> ids of the run heads attached to it, in creation order
    for _, _, first, _, at in runs:
        if at >= 0:
            attached.setdefault(at, []).append(first)
    # pieces: runs cut after each attach point; (first id, length), in id order
    pieces: list[tuple[int, int]] = []
    points = sorted(attached)
    for _, _, first, length, _ in runs:
        cuts = [a + 1 for a in points[bisect_left(points, first):bisect_left(points, first + length - 1)]]
        for lo, hi in zip([first] + cuts, cuts + [first + length]):
            pieces.append((lo, hi - lo))
    starts = [lo for lo, _ in pieces]
    piece_at = {lo: k for k, lo in enumerate(starts)}
    last_of_run = {first + length - 1 for _, _, first, length, _ in runs}

    def children(last: int) -> list[int]:  # child pieces of a piece ending at node ``last``, in creation order
        heads = ([] if last in last_of_run else [last + 1]) + attached.get(last, [])
        return [piece_at[x] for x in sorted(heads)]

    # depth-first over pieces: a piece opens a segment unless it is the only child of the node before it
    phys_start = [0] * len(pieces)
    seg_of_piece = [0] * len(pieces)
    seg_parents: list[int] = []
    seg_lengths: list[int] = []
    seg_tree: list[int] = []
    stack = [(piece_at[first], -1, True) for _, h, first, _, _ in reversed(runs) if h == 0]
    pos = 0
    while stack:
        k, parent, opens = stack.pop()
        lo, length = pieces[k]
        phys_start[k] = pos
        pos += length
        if opens:
            seg_parents.append(-1 if parent < 0 else seg_of_piece[parent])
            seg_tree.append(seg_tree[seg_of_piece[parent]] if parent >= 0 else (seg_tree[-1] + 1 if seg_tree else 0))
            seg_lengths.append(length)
        else:
            seg_lengths[-1] += length
        seg_of_piece[k] = len(seg_lengths) - 1
        kids = children(lo + length - 1)
        stack.extend((c, k, len(kids) > 1) for c in reversed(kids))

    lens = torch.tensor([ln for _, ln in pieces], dtype=torch.long)
    shift = torch.tensor(phys_start, dtype=torch.long) - torch.tensor(starts, dtype=torch.long)
    phys_of_id = torch.repeat_interleave(shift, lens) + torch.arange(n_nodes)  # [n_nodes]
    run_len = torch.tensor([r[3] for r in runs], dtype=torch.long)
    run_seq = torch.repeat_interleave(torch.tensor([r[0] for r in runs], dtype=torch.long), run_len)
    run_t0 = torch.repeat_interleave(torch.tensor([r[2] - r[1] for r in runs], dtype=torch.long), run_len)
    src = torch.empty(n_nodes, 2, dtype=torch.long)
    src[phys_of_id] = torch.stack([run_seq, torch.arange(n_nodes) - run_t0], 1)
    paths = tuple(phys_of_id[p] for p in id_paths)
    # a sequence's first node is a root: the head of a run that shares nothing, so the start of a piece
    tree_of = tuple(seg_tree[seg_of_piece[piece_at[int(p[0])]]] if p.numel() else -1 for p in id_paths)
    tree_tokens = [0] * (seg_tree[-1] + 1 if seg_tree else 0)
    for tr, ln in zip(seg_tree, seg_lengths):
        tree_tokens[tr] += ln
    return PrefixTrie(tuple(seg_parents), tuple(seg_lengths), paths, src, tree_of, tuple(tree_tokens))


def plan_micro_batches(tree_tokens: Sequence[int], budget: int, names: Sequence[str] | None = None
                       ) -> list[list[int]]:
    """Pack trees into rows of at most ``budget`` tokens, first-fit decreasing; a tree is never split.

    Args:
        tree_tokens: tokens of each tree.
        budget: the most tokens one row may hold.
        names: optional description of each tree for the error message.

    Returns:
        rows, each a list of tree indices in increasing order; rows ordered by their first tree.

    Raises:
        ValueError: ``budget`` is not a positive integer, or a tree alone needs more than ``budget``.
    """
    if not is_int(budget, 1):
        raise ValueError(f"budget must be a positive number of tokens, got {budget!r}")
    for j, n in enumerate(tree_tokens):
        if n > budget:
            what = names[j] if names is not None else f"tree {j}"
            raise ValueError(f"{what} needs {n} tokens in one row (a tree is never split across rows) but the "
                             f"budget is {budget}: raise the budget to at least {max(tree_tokens)}")
    bins: list[list[int]] = []
    free: list[int] = []
    for j in sorted(range(len(tree_tokens)), key=lambda j: (-tree_tokens[j], j)):
        for b, room in enumerate(free):
            if tree_tokens[j] <= room:
                bins[b].append(j)
                free[b] -= tree_tokens[j]
                break
        else:
            bins.append([j])
            free.append(budget - tree_tokens[j])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def plan_rows(sequences: Sequence[Sequence[Hashable]], budget: int) -> list[list[int]]:
    """Which sequences go in which row: the trie's trees packed under ``budget`` tokens per row.

    Returns one list of sequence indices per row, each in input order (see :func:`plan_micro_batches`;
    a tree's error message names its first sequences).
    """
    trie = build_trie(sequences)
    members: list[list[int]] = [[] for _ in trie.tree_tokens]
    for k, tr in enumerate(trie.tree_of):
        members[tr].append(k)

    def name(tr: int) -> str:
        m = members[tr]
        shown = ", ".join(map(str, m[:8])) + (", ..." if len(m) > 8 else "")
        return f"tree {tr} (sequences {shown}; {len(m)} in all)"

    rows = plan_micro_batches(trie.tree_tokens, budget, [name(tr) for tr in range(len(members))])
    return [sorted(k for tr in trees for k in members[tr]) for trees in rows]


def sorted_lcp(seqs: Sequence[Sequence[Hashable]]) -> tuple[list[int], list[int]]:
    """``(order, lcp)``: the indices of ``seqs`` in lexicographic order, and ``lcp[k]``, the length of the common
    prefix of ``seqs[order[k - 1]]`` and ``seqs[order[k]]`` (``lcp[0] = 0``). The trie of ``seqs[order[:k + 1]]``
    has ``sum(len) - sum(lcp[:k + 1])`` tokens."""
    lists = [s.tolist() if isinstance(s, Tensor) else list(s) for s in seqs]
    order = sorted(range(len(lists)), key=lambda i: lists[i])
    lcp = [0] * len(order)
    for k in range(1, len(order)):
        a, b = lists[order[k - 1]], lists[order[k]]
        n, i = min(len(a), len(b)), 0
        while i < n and a[i] == b[i]:
            i += 1
        lcp[k] = i
    return order, lcp


class SortedNodes:
    """The trie of ``seqs`` as ranges of their lexicographic order: a node is ``(a, b)``, the sequences
    ``order[a:b]``, which share their first ``depth(a, b)`` tokens. The planners that cut a trie into
    forwards under a token budget walk it with these (``verl_plan.plan_forwards``, ``verl_stream``).

    Attributes:
        order, lcp: :func:`sorted_lcp` of ``seqs``.
        lens: ``lens[k]`` = length of ``seqs[order[k]]``.
    """

    def __init__(self, seqs: Sequence[Sequence[Hashable]]):
        self.order, self.lcp = sorted_lcp(seqs)
        self.lens = [len(seqs[i]) for i in self.order]

    def cost(self, a: int, b: int) -> int:
        """Tokens of the trie of ``order[a:b]`` (each shared prefix once)."""
        return self.lens[a] + sum(self.lens[k] - self.lcp[k] for k in range(a + 1, b))

    def depth(self, a: int, b: int) -> int:
        """Tokens every sequence of the node shares (its whole length for one sequence)."""
        return min(self.lcp[a + 1:b], default=self.lens[a])

    def is_leaf(self, a: int, b: int) -> bool:
        """One sequence, or identical copies: nothing to cut."""
        return b - a == 1 or self.depth(a, b) == max(self.lens[a:b])

    def children(self, a: int, b: int) -> list[tuple[int, int]]:
        """The node's children in order: its ranges split where the common prefix ends (at ``depth``)."""
        d = self.depth(a, b)
        bounds = [a] + [k for k in range(a + 1, b) if self.lcp[k] == d] + [b]
        return [(bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1)]
