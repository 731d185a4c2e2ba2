"""Plans for verl: which samples share a forward, and which rank a prompt's group goes to.

Pure planning on token sequences (no model, no verl import at module level), used by
:mod:`flexgroup.integrations.verl` (the engine plans a whole mini-batch) and callable from verl's
trainer (:func:`balance_batch` replaces ``RayPPOTrainer._balance_batch``).

The grouped cost of a set of sequences is the size of their token-level prefix trie: sorted
lexicographically, sequence ``k`` adds ``len_k - lcp(k-1, k)`` tokens (a common prefix is encoded
once, an identical sequence adds nothing). That is the number of tokens flexgroup's packed row holds
(:meth:`flexgroup.GroupedBatch.from_padded` with ``share="trie"``); its causal attention pairs are the
sum of the new tokens' depths (:meth:`flexgroup.Layout.cost`'s grouped pairs).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from flexgroup.layout.trie import SortedNodes, sorted_lcp

__all__ = ["ForwardPlan", "grouped_tokens", "grouped_workload", "plan_forwards", "group_balanced_partitions",
           "balance_batch", "install_balance", "TOKEN_WEIGHT"]

Tokens = Sequence[int]
LAST_LABEL = "flexgroup_last_label"  # [N] per sample: the token verl's rolled labels put after its last token

TOKEN_WEIGHT = 24576  # verl's calculate_workload: 24576 * tokens + tokens**2 (a 7B model's linear vs attention)


def grouped_tokens(seqs: Sequence[Tokens]) -> int:
    """Tokens of the sequences' prefix trie (each common prefix once): ``sum(len) - sum(lcp)`` in sorted order."""
    order, lcp = sorted_lcp(seqs)
    return sum(len(seqs[i]) for i in order) - sum(lcp)


def grouped_workload(seqs: Sequence[Tokens]) -> int:
    """verl's workload measure (``24576 * tokens + tokens**2`` per sequence, ~2 x the causal pairs) for the
    GROUPED row: ``24576 * trie tokens + 2 * trie attention pairs`` (a trie token at depth ``t`` attends to
    ``t`` tokens). Equals verl's ``calculate_workload`` sum up to ``+len`` per sequence when nothing is shared."""
    order, lcp = sorted_lcp(seqs)
    tokens = pairs = 0
    for k, i in enumerate(order):
        n, c = len(seqs[i]), lcp[k]
        tokens += n - c
        pairs += n * (n + 1) // 2 - c * (c + 1) // 2
    return TOKEN_WEIGHT * tokens + 2 * pairs


@dataclass
class ForwardPlan:
    """Forwards for one mini-batch.

    Attributes:
        forwards: sample indices per forward (each a prefix-trie-ordered list); every sample exactly once.
        costs: grouped tokens per forward.
        cuts: ``(prefix_tokens, subtree_tokens, forwards_spanned)`` for each trie node bigger than the
            budget whose prefix is re-encoded in more than one forward.
    """

    forwards: list[list[int]]
    costs: list[int]
    cuts: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(self.costs)


def plan_forwards(seqs: Sequence[Tokens], budget: int, min_forwards: int = 1) -> ForwardPlan:
    """Partition samples into forwards of at most ``budget`` grouped tokens, keeping each trie node whole
    while it fits.

    A node (the samples below one common prefix) that fits the budget is one unit; a bigger node is
    split at its branching point into its children, recursively (its prefix is then re-encoded in each
    forward its children land in: recorded in ``ForwardPlan.cuts``). A single sequence longer than the budget
    is a forward of its own (as verl's dynamic batching does). Units are taken in trie order and packed
    next-fit, so neighbours (which share the longest prefixes) share a forward. ``min_forwards``: split
    the largest forwards (at their trie-order midpoint) until there are at least this many (FSDP needs
    the same number of forwards on every data-parallel rank); impossible beyond ``len(seqs)`` forwards.
    """
    if budget < 1:
        raise ValueError(f"budget={budget}: the per-forward token budget must be positive")
    n = len(seqs)
    if n == 0:
        return ForwardPlan([], [])
    trie = SortedNodes(seqs)
    order, lcp, cost = trie.order, trie.lcp, trie.cost
    units: list[tuple[int, int]] = []
    cut_nodes: list[tuple[int, int, int, int]] = []  # (a, b, depth, cost)
    stack = [(0, n)]
    while stack:
        a, b = stack.pop()
        c = cost(a, b)
        if c <= budget or trie.is_leaf(a, b):  # fits, one sequence, or identical copies
            units.append((a, b))
            continue
        cut_nodes.append((a, b, trie.depth(a, b), c))
        stack.extend(reversed(trie.children(a, b)))
    units.sort()
    forwards: list[list[int]] = []
    costs: list[int] = []
    for a, b in units:
        c = cost(a, b)
        if forwards and costs[-1] + c - lcp[a] <= budget:
            forwards[-1].extend(range(a, b))
            costs[-1] += c - lcp[a]
        else:
            forwards.append(list(range(a, b)))
            costs.append(c)
    while len(forwards) < min(min_forwards, n):
        j = max((k for k in range(len(forwards)) if len(forwards[k]) > 1), key=lambda k: costs[k])
        f = forwards[j]
        halves = [f[:len(f) // 2], f[len(f) // 2:]]
        forwards[j:j + 1] = halves
        costs[j:j + 1] = [cost(h[0], h[-1] + 1) for h in halves]  # forwards are contiguous in trie order
    where = {}
    for j, f in enumerate(forwards):
        for k in f:
            where[k] = j
    cuts = [(d, c, len({where[k] for k in range(a, b)})) for a, b, d, c in cut_nodes]
    return ForwardPlan([[order[k] for k in f] for f in forwards], costs, [x for x in cuts if x[2] > 1])


# ---------------------------------------------------------------------------------------- balancing
def group_balanced_partitions(seqs: Sequence[Tokens], uids: Sequence, k: int) -> list[list[int]]:
    """Sample indices per data-parallel rank: each ``uid`` group whole on one rank, ranks balanced by the
    groups' grouped workload (:func:`grouped_workload`), the same number of groups on every rank.

    Greedy longest-processing-time: groups by decreasing workload, each to the least-loaded rank that
    still has room. Within a rank, groups keep their batch order and a group's samples stay contiguous
    (so verl's mini-batch and micro-batch splits keep whole groups). ValueError when the groups cannot
    give every rank the same number of samples (verl's dispatch splits the batch equally).
    """
    if len(seqs) != len(uids):
        raise ValueError(f"{len(seqs)} sequences but {len(uids)} uids")
    members: dict = {}
    for i, u in enumerate(uids):
        members.setdefault(u, []).append(i)
    groups = sorted(members.values(), key=lambda m: m[0])
    sizes = {len(m) for m in groups}
    if len(groups) % k or len(sizes) != 1:
        raise ValueError(f"{len(groups)} uid groups of sizes {sorted(sizes)} cannot be split into {k} ranks of "
                         f"equal sample counts with whole groups; use a number of prompts that is a multiple of "
                         f"the data-parallel size ({k}) and one rollout.n for every prompt")
    work = [grouped_workload([seqs[i] for i in m]) for m in groups]
    room, load = [len(groups) // k] * k, [0] * k
    ranks: list[list[int]] = [[] for _ in range(k)]
    for g in sorted(range(len(groups)), key=lambda g: (-work[g], g)):
        r = min((r for r in range(k) if room[r]), key=lambda r: (load[r], r))
        ranks[r].append(g)
        room[r] -= 1
        load[r] += work[g]
    return [[i for g in sorted(gs) for i in groups[g]] for gs in ranks]


def balance_batch(self, batch, metrics: dict, logging_prefix: str = "global_seqlen", keep_minibatch: bool = False,
                  *, stock):
    """Drop-in for verl 0.9's ``RayPPOTrainer._balance_batch`` (installed, the same signature; reorders ``batch``
    in place): every prompt's group (``batch.non_tensor_batch["uid"]``) stays whole on one data-parallel rank and in
    order, ranks balanced by grouped workload (:func:`group_balanced_partitions`) instead of raw lengths.
    With ``keep_minibatch`` each mini-batch (``actor.ppo_mini_batch_size`` rows, as verl slices it) is
    balanced on its own. Without ``uid``, or when the groups cannot be split equally, verl's own
    balancing runs, with one warning. ``stock``: that balancing, verl's own ``_balance_batch`` (an unbound
    method of the trainer class); :func:`install_balance` binds it.
    """
    from verl.utils.seqlen_balancing import log_seqlen_unbalance

    mask = batch.batch["attention_mask"]
    ids = batch.batch["input_ids"]
    seqs = [ids[i][mask[i].bool()].tolist() for i in range(len(ids))]
    dp = self._get_dp_size(self.actor_rollout_wg, "actor")
    uids = batch.non_tensor_batch.get("uid")
    size = self.config.actor_rollout_ref.actor.get("ppo_mini_batch_size") if keep_minibatch else len(seqs)
    try:
        if uids is None:
            raise ValueError("the batch has no 'uid' (non_tensor_batch['uid'] names each sample's prompt)")
        parts: list[list[int]] = [[] for _ in range(dp)]
        for s in range(0, len(seqs), size):
            sub = group_balanced_partitions(seqs[s:s + size], list(uids[s:s + size]), dp)
            for r, p in enumerate(sub):
                parts[r] += [i + s for i in p]
    except ValueError as e:
        warnings.warn(f"flexgroup: balance_batch keeps verl's own balancing (groups may be split over ranks): {e}",
                      stacklevel=3)   # the trainer's call, past the partialmethod that install_balance binds
        return stock(self, batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
    import torch

    batch.reorder(torch.tensor([i for p in parts for i in p]))
    metrics.update(log_seqlen_unbalance(seqlen_list=[len(s) for s in seqs], partitions=parts, prefix=logging_prefix))
    costs = [grouped_tokens([seqs[i] for i in p]) for p in parts]
    metrics.update({f"{logging_prefix}/grouped_tokens_max": max(costs), f"{logging_prefix}/grouped_tokens_min": min(costs)})


def install_balance(trainer_cls=None) -> None:
    """Make :func:`balance_batch` the ``_balance_batch`` of verl's ``RayPPOTrainer`` (or ``trainer_cls``), with
    the class's own ``_balance_batch`` bound as its ``stock`` fallback; idempotent (a class that already has
    it, itself or through a base class, is left as it is). Call it in the driver process before
    ``trainer.fit()`` (e.g. in a custom ``main_ppo`` task runner)."""
    if trainer_cls is None:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer as trainer_cls
    current = inspect.getattr_static(trainer_cls, "_balance_batch")
    if not (isinstance(current, functools.partialmethod) and current.func is balance_batch):
        trainer_cls._balance_batch = functools.partialmethod(balance_batch, stock=trainer_cls._balance_batch)
