"""Token-level prefix tries over many sequences, and token-budget micro-batch plans.

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

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from .checks import is_int

__all__ = ["PrefixTrie", "build_trie", "plan_micro_batches", "plan_rows"]

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


def build_trie(sequences: Sequence[Sequence[Hashable]]) -> PrefixTrie:
    """Token-level prefix trie over ``sequences`` (each a non-empty list of hashable keys, e.g. token ids).

    Two tokens share a node iff the two sequences agree on every key up to and including them.
    Nodes are numbered in pre-order (children in order of first appearance), so each tree, and each
    segment, is contiguous in the packed row, and trees appear in order of first appearance.
    """
    children: list[dict] = [{}]      # node 0: a virtual root above every tree
    parent = [-1]
    source: list[tuple[int, int]] = [(-1, -1)]
    node_paths = []
    for i, seq in enumerate(sequences):
        node, path = 0, []
        for t, key in enumerate(seq):
            nxt = children[node].get(key)
            if nxt is None:
                nxt = len(parent)
                children[node][key] = nxt
                children.append({})
                parent.append(node)
                source.append((i, t))
            path.append(nxt)
            node = nxt
        node_paths.append(path)
    n = len(parent)
    phys = [0] * n
    seg_of = [0] * n
    order: list[int] = []
    seg_parents: list[int] = []
    seg_lengths: list[int] = []
    seg_tree: list[int] = []
    stack = list(reversed(children[0].values()))
    while stack:
        x = stack.pop()
        phys[x] = len(order)
        order.append(x)
        stack.extend(reversed(children[x].values()))
        p = parent[x]
        if p == 0 or len(children[p]) > 1:  # a root or the first node after a branch point
            seg_parents.append(-1 if p == 0 else seg_of[p])
            seg_tree.append(seg_tree[seg_of[p]] if p else (seg_tree[-1] + 1 if seg_tree else 0))
            seg_lengths.append(1)
        else:  # the only child of the previous node in pre-order: same segment
            seg_lengths[-1] += 1
        seg_of[x] = len(seg_lengths) - 1
    phys_t = torch.tensor(phys, dtype=torch.long)
    paths = tuple(phys_t[torch.tensor(p, dtype=torch.long)] for p in node_paths)
    src = torch.tensor(source, dtype=torch.long)[torch.tensor(order, dtype=torch.long)].reshape(-1, 2)
    n_trees = seg_tree[-1] + 1 if seg_tree else 0
    tree_tokens = [0] * n_trees
    for tr, ln in zip(seg_tree, seg_lengths):
        tree_tokens[tr] += ln
    tree_of = tuple(seg_tree[seg_of[p[0]]] if p else -1 for p in node_paths)
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
