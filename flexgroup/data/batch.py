"""GroupedBatch: user tensors <-> one packed model row, and per-sequence log-probs back.

Sequences that share leading tokens pack into one row described by a :class:`Layout` forest:

- :meth:`GroupedBatch.from_groups` / :meth:`~GroupedBatch.from_padded`: one prompt and G responses
  per group, one two-level tree per group ``[P1; R11; ...; P2; R21; ...]``;
- :meth:`GroupedBatch.from_sequences` / :meth:`~GroupedBatch.from_padded_sequences`: a token-level
  prefix trie over the whole list (multi-turn trajectories, tree rollouts, shared system prompts);
- :meth:`GroupedBatch.from_layout`: any user-built layout; :func:`micro_batches`: rows under a budget.

One machinery: output row ``i`` is a sequence given by its *path* (the packed index of each of its
tokens, in order) and a loss mask; the log-prob of token ``t`` is read from the logit row of its
path's token ``t - 1`` (after a branch point: the ancestor segment's last position, a row every
branch shares; autograd sums the branches' contributions as the repeated baseline does). The
patched model reads the layout from the ``attention_mask`` of :meth:`GroupedBatch.model_inputs`.

No transformers import here.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from . import padded, sharding
from .carrier import GroupedMask, tag_position_ids
from ..layout.checks import bool_mask, check_loss_masks, check_sequences, check_temperature, is_int, normal_tensors, token_ids
from ..layout.checks import loss_mask as checked_loss_mask
from ..layout import Cost, Layout
from .fused_readout import LMHead, read_scores_fused
from .readout import HEAD_ROWS, read_plan, read_scores
from ..layout.trie import build_trie, plan_rows

__all__ = ["GroupedBatch", "MicroBatches", "micro_batches"]

Tensor = torch.Tensor


def group_parts(prompts: list[Tensor], responses: list[list[Tensor]], order: Sequence[int] | None
                 ) -> tuple[Layout, Tensor, list[Tensor], list[Tensor], list[int]]:
    """One two-level tree per group; the paths, loss masks and skips of the responses in output order.

    ``responses[g]`` are listed in packing order; ``order[k]`` is the output row of the k-th packed
    response (default: packing order).
    """
    layouts, pieces = [], []
    for p, rs in zip(prompts, responses):
        layouts.append(Layout.group(p.numel(), [r.numel() for r in rs]))
        pieces += [p] + list(rs)
    layout = Layout.pack(layouts)
    packed_paths, skips = [], []
    seg = 0
    for rs in responses:
        prompt_idx = torch.arange(layout.starts[seg], layout.starts[seg] + layout.lengths[seg])
        for j in range(len(rs)):
            s = seg + 1 + j
            packed_paths.append(torch.cat([prompt_idx, torch.arange(layout.starts[s], layout.starts[s] + layout.lengths[s])]))
            skips.append(layout.lengths[seg])
        seg += 1 + len(rs)
    n = len(packed_paths)
    order = list(range(n)) if order is None else list(order)
    paths, skip = [None] * n, [0] * n
    for k, o in enumerate(order):
        paths[o], skip[o] = packed_paths[k], skips[k]
    masks = [torch.arange(p.numel()) >= s for p, s in zip(paths, skip)]
    return layout, torch.cat(pieces), paths, masks, skip


def head_rows(logit_rows: Tensor, num_tokens: int) -> Tensor:
    """The packed positions ``model_inputs(needed_logits_only=True)`` passes as ``logits_to_keep``.

    Args:
        logit_rows: LongTensor [K], sorted positions whose logits are read.
        num_tokens: L, the row's length.

    Returns:
        LongTensor [K']: ``logit_rows`` followed by the first positions not among them, up to
        :data:`HEAD_ROWS` rows (K' = max(K, HEAD_ROWS)), so the logits of the K rows come first and
        their values do not depend on K. A row of at most ``HEAD_ROWS`` tokens keeps every position,
        in order (K' = L: the full logits).
    """
    if logit_rows.numel() >= HEAD_ROWS:
        return logit_rows
    if num_tokens <= HEAD_ROWS:
        return torch.arange(num_tokens)
    free = torch.ones(num_tokens, dtype=torch.bool)
    free[logit_rows] = False
    pad = torch.nonzero(free)[: HEAD_ROWS - logit_rows.numel(), 0]
    return torch.cat([logit_rows, pad])


class GroupedBatch:
    """Sequences packed into one row with shared prefixes, and the metadata to read log-probs back (build it
    with a ``from_*`` classmethod; mask arguments are bool or 0/1 values: :func:`flexgroup.layout.checks.bool_mask`).

    Attributes:
        layout: the packed :class:`Layout` (a forest of segments).
        input_ids: LongTensor [L], the packed row.
        num_responses: N, output rows (responses, or sequences) in input order.
        response_lengths: list[int] of length N: tokens of each row's output span (a response's length
            for group batches, the whole sequence for tree batches).
        response_mask: BoolTensor [N, max_len], True where a log-prob is read (the loss mask).
        group_of_response: LongTensor [N], index of the tree (group) each row belongs to, trees in packed order.
        logit_rows: LongTensor [K], sorted packed positions whose logits :meth:`logprobs` reads.
        paths: per output row, LongTensor [n_i]: the packed index of each token of its whole sequence
            (prompt included), so ``input_ids[paths[i]]`` is sequence ``i``.
        sequence_ends: N ints, ``paths[i][-1]`` (it may be inside a segment): every per-sequence fact's source.
    """

    @normal_tensors  # a batch made under torch.inference_mode() can still be trained on
    def __init__(self, layout: Layout, input_ids: Tensor, paths: Sequence[Tensor], loss_masks: Sequence[Tensor],
                 skip: Sequence[int] | None = None, width: int | None = None):
        """Low-level constructor (use the ``from_*`` classmethods; arguments are trusted).

        Args:
            layout: the packed layout, ``layout.num_tokens == L``.
            input_ids: LongTensor [L].
            paths: per output row, LongTensor [n_i]: packed index of each token of the row's sequence.
            loss_masks: per output row, BoolTensor [n_i], False at 0: where a log-prob is read.
            skip: per output row, the sequence position that output column 0 holds (default 0).
            width: output columns ``max_len`` (default: the longest ``n_i - skip_i``).
        """
        self.layout: Layout = layout
        # packed under inference mode: clones, since an embedding with gradients saves its ids for backward
        self.input_ids: Tensor = input_ids.clone() if input_ids.is_inference() else input_ids
        self.paths: list[Tensor] = [p.clone() if p.is_inference() else p for p in paths]
        n = len(paths)
        skip_t = torch.zeros(n, dtype=torch.long) if skip is None else torch.tensor(list(skip), dtype=torch.long)
        lens_t = torch.tensor([p.numel() for p in paths], dtype=torch.long)
        self.num_responses: int = n
        self.response_lengths: list[int] = (lens_t - skip_t).tolist()
        self.max_len: int = max(self.response_lengths) if width is None else int(width)
        comp = torch.tensor(layout.component, dtype=torch.long)
        tree_index = torch.zeros(layout.num_segments, dtype=torch.long)
        tree_index[list(layout.roots)] = torch.arange(len(layout.roots))
        seg = layout.seg_id
        self.group_of_response = tree_index[comp[seg[torch.stack([p[0] for p in paths])]]]
        self.sequence_ends: tuple[int, ...] = tuple(torch.stack([p[-1] for p in paths]).tolist())
        flat_path = torch.cat(list(paths))                                    # [sum n_i]
        row = torch.repeat_interleave(torch.arange(n), lens_t)               # [sum n_i]
        first = lens_t.cumsum(0) - lens_t
        at = torch.nonzero(torch.cat(list(loss_masks)))[:, 0]                 # flat positions with t >= 1
        t = at - first[row[at]]
        # per scored token: which logit row predicts it (the path's previous token), the token, where it goes
        pred = flat_path[at - 1]
        self._pred_idx = pred                                                 # [T] logit row predicting each token
        self._targets = input_ids[flat_path[at]]                              # [T] the token
        self._flat_out = row[at] * self.max_len + t - skip_t[row[at]]         # [T] index into [N * max_len]
        mask = torch.zeros(n * self.max_len, dtype=torch.bool)
        mask[self._flat_out] = True
        self.response_mask: Tensor = mask.view(n, self.max_len)
        # the logit rows log-probs read, and where each predicted token's row sits among them
        self.logit_rows: Tensor = torch.unique(pred)                          # [K] sorted physical indices
        self._pred_in_rows = torch.searchsorted(self.logit_rows, pred)        # [T]
        self.head_rows: Tensor = head_rows(self.logit_rows, self.num_tokens)  # [K'] logits_to_keep
        self._dev: dict[str, tuple[Tensor, Tensor, Tensor]] = {}

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_groups(cls, prompts: Sequence[Tensor], responses: Sequence[Sequence[Tensor]]) -> "GroupedBatch":
        """Pack groups given as token ids.

        Args:
            prompts: list of P_g LongTensors [len_g] (1-D).
            responses: list (one entry per prompt) of lists of 1-D LongTensors; responses are numbered
                in this order (group by group) in :meth:`logprobs`.
        """
        prompts, responses = list(prompts), [list(r) for r in responses]
        if not prompts:
            raise ValueError("from_groups: no prompts given")
        if len(prompts) != len(responses):
            raise ValueError(f"from_groups: {len(prompts)} prompts but {len(responses)} response lists "
                             "(give one list of responses per prompt)")
        ps, rs, k = [], [], 0
        for g, (p, r) in enumerate(zip(prompts, responses)):
            ps.append(token_ids(p, f"prompt {g}"))
            if not r:
                raise ValueError(f"prompt {g} has no responses: a group needs at least one response")
            out = []
            for j, x in enumerate(r):
                out.append(token_ids(x, f"response {j} of prompt {g} (response index {k})"))
                k += 1
            rs.append(out)
        return cls(*group_parts(ps, rs, None))

    @classmethod
    def from_padded(cls, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                    group_size: int | None = None, group_ids: Sequence | Tensor | None = None, *,
                    share: str = "groups") -> "GroupedBatch":
        """Pack trainer tensors (TRL / verl layout): one row per response.

        Args:
            prompt_ids, prompt_mask: [N, Lp], prompts left-padded (mask 1 on real tokens).
            completion_ids, completion_mask: [N, Lc], completions right-padded.
            group_size: G, groups are consecutive rows ``[g*G, (g+1)*G)``; or
            group_ids: [N] ids (any hashable / integer values), authoritative: rows with equal
                ids form a group, rows with different ids are never merged.
            share: ``"groups"`` (default): one copy of each group's prompt; ``"trie"``: every common
                prefix of the whole ``[prompt; completion]`` rows is shared (completions that share
                earlier turns, prompts that share a system prompt); no group_size / group_ids then.

        Members of a group must have identical prompt tokens (ValueError naming the group otherwise).
        :meth:`logprobs` returns ``[N, Lc]`` aligned with ``completion_ids``.
        """
        pid, pm, cid, cm = padded.check_padded(prompt_ids, prompt_mask, completion_ids, completion_mask)
        if share not in ("groups", "trie"):
            raise ValueError(f"from_padded: share={share!r} must be 'groups' or 'trie'")
        if share == "trie":
            if group_size is not None or group_ids is not None:
                raise ValueError("from_padded: share='trie' finds shared prefixes itself; drop group_size/group_ids")
            seqs, masks, skip = padded.trie_rows(pid, pm, cid, cm)
            return cls._trie_batch(seqs, masks, width=cid.shape[1], skip=skip)
        prompts, responses, order = padded.group_rows(pid, pm, cid, cm, group_size, group_ids)
        return cls(*group_parts(prompts, responses, order), width=cid.shape[1])

    @classmethod
    def from_sequences(cls, sequences: Sequence[Tensor], loss_masks: Sequence[Tensor] | None = None) -> "GroupedBatch":
        """Pack whole sequences, sharing every common prefix across the whole list (a token-level trie).

        A system prompt shared by every group, each group's prompt and earlier turns shared by tree
        rollouts are each encoded once; a sequence that is a prefix of another, and duplicates, read
        their log-probs along their own path. ``batch.num_tokens`` is the number of distinct prefixes.

        Args:
            sequences: N 1-D integer token-id tensors of any lengths (>= 1).
            loss_masks: optional N 1-D bool tensors of the same lengths: True where a token's log-prob
                is wanted (e.g. assistant tokens), False for context (system, user, tool tokens); never
                True at position 0; not all False. Default: every token but the first.

        :meth:`logprobs` then returns ``[N, max_len]`` with ``lp[i, t] = log p(seq_i[t] | seq_i[:t])``
        where ``response_mask[i, t]`` (= the loss mask) and 0 elsewhere; ``max_len`` is the longest sequence.
        """
        seqs = check_sequences(sequences)
        masks = check_loss_masks(loss_masks, seqs)
        return cls._trie_batch(seqs, masks)

    @classmethod
    def _trie_batch(cls, seqs: list[Tensor], masks: list[Tensor], width: int | None = None,
                    skip: Sequence[int] | None = None) -> "GroupedBatch":
        trie = build_trie([s.tolist() for s in seqs])
        input_ids = trie.packed_row(seqs)   # [L]
        return cls(Layout.tree(trie.parents, trie.lengths), input_ids, list(trie.paths), masks,
                   skip=skip, width=width)

    @classmethod
    def from_padded_sequences(cls, input_ids: Tensor, attention_mask: Tensor | None = None,
                              loss_mask: Tensor | None = None, *, completion_mask: Tensor | None = None,
                              tool_mask: Tensor | None = None) -> "GroupedBatch":
        """Pack trainer tensors of whole right-padded sequences (multi-turn trainers' layout) as a trie.

        Args:
            input_ids: [N, L] token ids, each row right-padded.
            attention_mask: [N, L], 1 on real tokens (a run of 1s then 0s); default all real.
            loss_mask: [N, L], 1 where a token's log-prob is wanted; or TRL-style
            completion_mask: [N, L] (1 on completion tokens) and optionally
            tool_mask: [N, L] (0 on tool-result tokens inside the completion, 1 elsewhere); the loss
                mask is then ``completion_mask & tool_mask``. All masks aligned with ``input_ids``.
                Default: every real token but the first. Column 0 and padding may not be in the loss.

        :meth:`logprobs` returns ``[N, L]`` aligned with ``input_ids`` (0 outside the loss mask).
        """
        seqs, masks, width = padded.sequence_rows(input_ids, attention_mask, loss_mask, completion_mask, tool_mask)
        return cls._trie_batch(seqs, masks, width=width)

    @classmethod
    def from_layout(cls, layout: Layout, input_ids: Tensor, loss_mask: Tensor | None = None) -> "GroupedBatch":
        """Use any user-built layout (:meth:`Layout.tree` / ``group`` / ``pack``) over a packed row.

        Args:
            layout: the packed layout; its sequences are ``layout.paths()`` (root-to-leaf), in that order.
            input_ids: LongTensor [layout.num_tokens], the packed row.
            loss_mask: optional BoolTensor [layout.num_tokens] over the packed row (default all True);
                a token's entry applies on every path through it. The first token of a root is never
                scored (nothing predicts it).

        :meth:`logprobs` returns ``[len(layout.paths()), max path length]``.
        """
        if not isinstance(layout, Layout):
            raise ValueError(f"from_layout: layout must be a flexgroup.Layout, got {type(layout).__name__}")
        ids = torch.as_tensor(input_ids)
        if ids.ndim != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
            raise ValueError(f"from_layout: input_ids must be a 1-D integer tensor (the packed row), got shape "
                             f"{tuple(ids.shape)} dtype {ids.dtype}")
        if ids.numel() != layout.num_tokens:
            raise ValueError(f"from_layout: input_ids has {ids.numel()} tokens but the layout has "
                             f"{layout.num_tokens}: they must describe the same packed row")
        row_mask = torch.ones(layout.num_tokens, dtype=torch.bool)
        if loss_mask is not None:
            lm = torch.as_tensor(loss_mask)
            if lm.shape != (layout.num_tokens,):
                raise ValueError(f"from_layout: loss_mask must be a 1-D bool tensor of {layout.num_tokens} entries "
                                 f"(one per packed token), got shape {tuple(lm.shape)} dtype {lm.dtype}")
            row_mask = bool_mask(lm, "from_layout: loss_mask")
        paths = layout.paths()
        masks = []
        for j, p in enumerate(paths):
            m = row_mask[p].clone()
            m[0] = False
            masks.append(checked_loss_mask(m, p.numel(), f"from_layout: the loss mask along path {j} (leaf segment "
                                                  f"{layout.leaves[j]})"))
        return cls(layout, ids.to("cpu", torch.long, copy=True), paths, masks)   # never the caller's tensor

    # ------------------------------------------------------------------ model side
    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    @property
    def position_ids(self) -> Tensor:
        """LongTensor [L], virtual positions."""
        return self.layout.position_ids

    def cost(self) -> Cost:
        """Exact work of this row versus running each of its N sequences alone (see :meth:`Layout.cost`)."""
        return self.layout.cost(self.sequence_ends)

    def model_inputs(self, device: torch.device | str | None = None, *, needed_logits_only: bool = False, shard=None) -> dict:
        """Keyword arguments for the patched model: ``model(**batch.model_inputs())``.

        Returns ``input_ids`` [1, L], ``position_ids`` [1, L] (virtual), ``attention_mask`` (a
        :class:`flexgroup.data.carrier.GroupedMask` carrying the layout) and ``use_cache=False``.
        Every tensor is a fresh copy, never a view of the batch's own: editing the dict in place (masking
        ``input_ids``, ...) changes this call's forward only, never a later one from the same batch.

        Args:
            device: where the tensors go (default CPU).
            needed_logits_only: also pass ``logits_to_keep=self.head_rows``, so the LM head runs
                only on the K rows that :meth:`logprobs` reads (each group's last prompt position
                and its response tokens; padded to 16 rows, see :func:`head_rows`) and the model
                returns logits [1, K', V] instead of [1, L, V] -- what a trainer's repeated baseline
                computes too, without the prompt rows. Use it in training; leave it off to inspect
                logits at every position.
            shard: a process group: this rank's slice of the padded row (:func:`flexgroup.data.sharding.sharded_inputs`).
        """
        device = torch.device(device) if device is not None else torch.device("cpu")
        if shard is not None:
            return sharding.sharded_inputs(self, device, needed_logits_only, shard)
        sharding.note_inputs(self, None)
        pos = self.layout.position_ids.to(device, copy=True)[None]
        out = {"input_ids": self.input_ids.to(device, copy=True)[None],
               "position_ids": tag_position_ids(pos, self.layout),
               "attention_mask": GroupedMask(self.layout, device, None, self.sequence_ends), "use_cache": False}
        if needed_logits_only:
            out["logits_to_keep"] = self.head_rows.to(device, copy=True)
        return out

    # ------------------------------------------------------------------ reading back
    @normal_tensors
    def read_index(self, device: torch.device, needed_only: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Per scored token (T of them), on ``device`` (cached): the logit row that predicts it ([T], an
        index into the K ``logit_rows`` when ``needed_only``), the token [T], its flat output index [T]."""
        key = (str(device), needed_only)
        if key not in self._dev:
            pred = self._pred_in_rows if needed_only else self._pred_idx
            self._dev[key] = (pred.to(device), self._targets.to(device), self._flat_out.to(device))
        return self._dev[key]

    def logprobs(self, logits: Tensor, temperature: float = 1.0, return_entropy: bool = False,
                 chunk_size: int | None = None, *, shard=None, lm_head: LMHead | None = None
                 ) -> Tensor | tuple[Tensor, Tensor]:
        """Per-response token log-probs ``[N, max_len]`` (right-padded with 0, responses in input order).

        Entry ``[i, t] = log p(r_i[t] | P, r_i[:t])``; ``r_i[0]`` is read from the last prompt position.
        Each distinct logit row is read once (``chunk_size`` rows at a time, :mod:`flexgroup.data.readout`):
        its log-sum-exp is computed once whatever the number of sequences and targets that read it, and
        nothing of size ``[rows, V]`` besides the logits is held for backward. Half-precision logits are
        upcast to float32 per chunk.

        Args:
            logits: [1, L, V] (or [L, V]) from ``model(**batch.model_inputs())``, [1, K', V] from
                ``model_inputs(needed_logits_only=True)`` (K' = ``len(self.head_rows)``), or the
                rows ``logit_rows`` of either ([1, K, V], K = ``len(self.logit_rows)``).
            temperature: logits are divided by it before the softmax.
            return_entropy: also return the entropy of each predictive distribution, [N, max_len].
            chunk_size: distinct rows per chunk (default 4096 logit rows; fused: ``2**26 // V``).
            lm_head: fused readout (:mod:`flexgroup.data.fused_readout`): ``logits`` are then the hidden states [1, K or
                L, H] of ``hidden_forward(model, inputs)`` and this its head; same values and gradients, no logits held.
            shard: the group given to ``model_inputs(shard=)``: this rank's tokens, 0 elsewhere (flexgroup.data.sharding);
                logits whose row count fits another kind of forward made from this batch are refused.
        """
        if logits.ndim == 3:
            if logits.shape[0] != 1:
                raise ValueError(f"logprobs: expected logits [1, L, V] for one packed row, got {tuple(logits.shape)}")
            logits = logits[0]
        cpu = torch.device("cpu")  # the read plan is folded on the CPU (no device sync), then moved
        pred, tgt, flat = sharding.logit_read_index(self, logits, shard, cpu)  # checks the row count (and shard=)
        temperature = check_temperature("logprobs", temperature)
        if chunk_size is not None and not is_int(chunk_size, 1):
            raise ValueError(f"logprobs: chunk_size must be a positive int (logit rows per chunk), got {chunk_size!r}")
        plan, flat = read_plan(pred, tgt, logits.device), flat.to(logits.device)
        if lm_head is None:
            lp, ent = read_scores(logits, plan, temperature, return_entropy, chunk_size or 4096)  # [T], [T]
        elif shard is not None:
            raise NotImplementedError("logprobs: lm_head= (the fused readout) with shard= is not supported: read logits")
        else:
            lp, ent = read_scores_fused(logits, lm_head, plan, temperature, return_entropy, chunk_size)
        n, w = self.num_responses, self.max_len
        out = lp.new_zeros(n * w).index_put((flat,), lp).view(n, w)
        if not return_entropy:
            return out
        return out, ent.new_zeros(n * w).index_put((flat,), ent).view(n, w)

    def __repr__(self) -> str:
        return (f"GroupedBatch({len(self.layout.roots)} groups, {self.num_responses} responses, "
                f"{self.num_tokens} tokens)")


class MicroBatches(NamedTuple):
    """What :func:`micro_batches` returns.

    Attributes:
        batches: one :class:`GroupedBatch` per packed row.
        where: per input sequence, ``(b, i)``: its log-probs are row ``i`` of ``batches[b].logprobs(...)``.
    """

    batches: list[GroupedBatch]
    where: list[tuple[int, int]]


def micro_batches(sequences: Sequence[Tensor], budget: int, loss_masks: Sequence[Tensor] | None = None
                  ) -> MicroBatches:
    """Split a large rollout batch into packed rows of at most ``budget`` tokens each.

    The prefix trie is built over the whole list; its trees (sequences that share a first token, with
    everything they share) are packed whole, first-fit decreasing by tree size, so no prefix is encoded
    twice within a tree and a tree never spans two rows. Each row is
    ``GroupedBatch.from_sequences`` of its sequences, in input order.

    Args:
        sequences, loss_masks: as in :meth:`GroupedBatch.from_sequences`.
        budget: the most packed tokens per row.

    Returns:
        :class:`MicroBatches` ``(batches, where)``; ``where[k] = (b, i)`` locates sequence ``k``.

    Raises:
        ValueError: a tree needs more than ``budget`` tokens (names the tree, its first sequences and
            the tokens it needs), or any error of :meth:`GroupedBatch.from_sequences`.
    """
    seqs = check_sequences(sequences)
    masks = check_loss_masks(loss_masks, seqs)
    batches, where = [], [(0, 0)] * len(seqs)
    for b, ks in enumerate(plan_rows([s.tolist() for s in seqs], budget)):
        for i, k in enumerate(ks):
            where[k] = (b, i)
        batches.append(GroupedBatch._trie_batch([seqs[k] for k in ks], [masks[k] for k in ks]))
    return MicroBatches(batches, where)
