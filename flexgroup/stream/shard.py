"""Streaming on a sequence-parallel model: each streamed forward sharded over the group's ranks.

With ``flexgroup.patch(model, sequence_parallel=group)`` (``W`` ranks), :func:`flexgroup.stream_backward`
and :func:`flexgroup.stream_logprobs` run the *same schedule* as one process (the same packed rows and
chunks under the same ``budget``: a budget counts the tokens of one forward of the whole group) and
shard every forward over the group:

- a packed row (a tree that fits the budget) runs as ``batch.model_inputs(shard=group)``
  (:mod:`flexgroup.data.sharding`);
- a chunk of ``Q`` tokens is padded to ``Qp = W * ceil(Q / W)`` with one padding root segment (no real
  token attends to it, no hybrid state flows into or out of it) and rank ``r`` runs tokens
  ``[r * Qp / W, (r + 1) * Qp / W)``. Attention all-to-alls q/k/v to head shards ``[Hq / W, Qp, D]``
  (:mod:`flexgroup.kernels.ulysses`; KV heads replicated where they do not divide by ``W``) and attends
  there, :class:`ShardedChunkContext`, to ``[kept K/V of the chunk's context ; own K/V]``;
- **the shared prefix's keys and values are kept once, sharded by heads after the all-to-all**: each
  rank keeps ``[Hkv' / W, n, D]`` of every kept piece, which is exactly what its share of the heads
  attends to in every later chunk, so a later chunk needs no communication for its context (kept by
  sequence, every later chunk would all-to-all or all-gather the whole context in every layer, forward
  and backward). A hybrid mixer's kept recurrent state is likewise its rank's heads and its kept conv
  inputs its rank's channels (the shards :mod:`flexgroup.patches.sequence_parallel` scans on).
- log-probs: each rank scores the tokens whose predicting logit row it holds and the group sums
  them (:func:`sum_over_ranks`: all-reduce forward, identity backward), so every rank holds the whole
  ``[n, T]`` block, ``loss_fn`` sees the whole log-probs (any loss, not only sums over tokens) and
  returns the same value on every rank, and each rank's backward sends ``d loss / d lp`` into its own
  tokens only: **the parameter gradients summed over the group are the unsharded gradients** (the
  convention of ``patch(model, sequence_parallel=group)``; under FSDP over a dp x sp mesh multiply
  the loss by the sp size, docs/distributed.md).

Every rank must call with the same sequences, loss masks, temperature, budget and visual inputs:
:func:`check_call` all-gathers their fingerprint once per call, before the first forward, and every rank raises,
naming the field and the rank, where one differs (:mod:`flexgroup.data.agreement`). The streamed chunks'
forwards are then not checked again: the schedule is a function of what was compared.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..data.carrier import tag_position_ids
from ..kernels.ulysses import even_counts, replication, to_heads, to_sequence
from ..layout import Layout
from ..data.agreement import Fingerprint, check_agreement
from ..data.readout import read_plan, read_scores
from ..data.sharding import group_rank_world, row_shard
from .chunk_carrier import ChunkContext, StreamMask

__all__ = ["resolve_group", "check_streamable", "check_call", "refused", "sum_over_ranks", "ShardedChunkContext", "sharded_chunk_forward",
           "sharded_row"]

Tensor = torch.Tensor


def resolve_group(model: torch.nn.Module, sequence_parallel):
    """The process group a streamed call shards over, or None.

    ``sequence_parallel``: None (default) -- the group ``model`` was patched with (None if patched
    without); a ProcessGroup -- must be that group; False -- no sharding (each rank streams alone).
    """
    from ..patches import base_model, patched_language_model
    from ..patches.sequence_parallel import group_of

    if sequence_parallel is False:
        return None
    lm = patched_language_model(base_model(model, "stream_backward"))
    patched = None if lm is None else group_of(lm)
    if sequence_parallel is None or sequence_parallel is patched:
        return patched
    if not isinstance(sequence_parallel, dist.ProcessGroup):
        raise ValueError(f"flexgroup.stream_backward: sequence_parallel= takes the torch.distributed ProcessGroup "
                         f"the model was patched with (or None / False), got {type(sequence_parallel).__name__}")
    if patched is None:
        raise ValueError("flexgroup.stream_backward: streaming with sequence_parallel=group on a model patched "
                         "without sequence parallelism: call flexgroup.patch(model, sequence_parallel=group) first "
                         "(the same group)")
    raise ValueError("flexgroup.stream_backward: sequence_parallel= is another process group than the one the "
                     "model was patched with: pass the same group (or omit sequence_parallel= to use the model's)")


def check_streamable(model: torch.nn.Module, vision: bool = False) -> None:
    """Refuse, naming both features and the reason, what streaming cannot shard exactly (``vision``: the call
    carries images' features and M-RoPE ids, :mod:`flexgroup.stream.vision`)."""
    from ..patches import base_model

    base = base_model(model, "stream_backward")
    if getattr(base.config, "vision_config", None) is not None and not vision:
        model_type = getattr(base.config, "model_type", type(base).__name__)
        from .vision import SUPPORTED

        raise NotImplementedError(
            f"flexgroup.stream_backward: streaming with sequence parallelism on the vision-language model "
            f"{model_type} is not supported: images' features and M-RoPE positions are carried across chunks and "
            f"ranks only for {', '.join(SUPPORTED)} (flexgroup.stream.vision). Stream without sharding "
            "(sequence_parallel=False), or run the batch as MultimodalGroupedBatch rows")


def check_call(group, device: torch.device, train: bool, entropy: bool, sequences: list[Tensor],
               loss_masks: list[Tensor], temperature: float, budget: int, visual, plan) -> None:
    """Before a sharded streamed call's first collective: every rank of ``group`` holds the same call, token ids
    (``sequences``, N 1-D), loss masks (N 1-D bool), temperature, budget, visual inputs (the per-sequence kept
    dicts of :class:`flexgroup.stream.vision.StreamVision`, or None) and schedule (``plan``, a
    :class:`flexgroup.stream.plan.StreamPlan`); ValueError on every rank otherwise, naming the field and the rank."""
    who = "flexgroup.stream_backward" if train else "flexgroup.stream_logprobs"
    layout = (plan.trie.parents, plan.trie.lengths, plan.rows, [ch.tokens for ch in plan.chunks])
    fingerprint = Fingerprint.of(call=(who, entropy), layout=layout, input_ids=sequences, loss_masks=loss_masks,
                                 temperature=float(temperature), visual=visual, budget=budget)
    rank, world = group_rank_world(group)
    check_agreement(fingerprint, group, rank, world, device, who)


def refused(group, train: bool) -> None:
    """This rank refused its own arguments (its error follows): take part in :func:`check_call`'s all-gather
    with no fingerprint, so the group's other ranks raise naming this rank instead of waiting in it."""
    if group is not None:
        rank, world = group_rank_world(group)
        check_agreement(None, group, rank, world, torch.device("cpu"),
                        "flexgroup.stream_backward" if train else "flexgroup.stream_logprobs")


class _SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) forward; identity backward (every rank's loss is the same function of the sum)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def sum_over_ranks(x: Tensor, group) -> Tensor:
    """``x`` summed over ``group`` (same shape). Where each entry is non-zero on exactly one rank, the sum
    is that rank's value exactly. Backward: the gradient goes unchanged to every rank's own ``x``."""
    return _SumOverRanks.apply(x, group)


class ShardedChunkContext(ChunkContext):
    """A :class:`ChunkContext` whose layer calls hold this rank's tokens: attention goes to head shards.

    ``layout`` must end with the chunk's padding segment (if any); kept keys and values are recorded
    (and read) on the head shards, ``[1, Hkv' / W, n, D]`` per kept piece.
    """

    def __init__(self, *args, group, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def attend(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, pattern, score_mod,
               scale: float) -> Tensor:
        """q [1, Hq, c, D], k/v [1, Hkv, c, D] (this rank's ``c = Qp / W`` tokens) -> [1, Hq, c, D]."""
        world = dist.get_world_size(self.group)
        hq, hkv = query.shape[1], key.shape[1]
        f = replication(hq, hkv, world, f"{type(module).__name__} (query heads {hq}, key/value heads {hkv})")
        if f > 1:
            key, value = key.repeat_interleave(f, 1), value.repeat_interleave(f, 1)
        cq, ckv = even_counts(hq, world), even_counts(hkv * f, world)
        qh, kh, vh = to_heads([query[0], key[0], value[0]], [cq, ckv, ckv], self.group)  # [h, Qp, D]
        out = super().attend(module, qh[None], kh[None], vh[None], pattern, score_mod, scale)  # [1, hq/W, Qp, D]
        return to_sequence([out[0]], [cq], self.group)[0][None]


def _padded(layout: Layout, pad: int) -> Layout:
    return layout if pad == 0 else Layout.pack([layout, Layout.tree([-1], [pad])])


def sharded_chunk_forward(model: torch.nn.Module, input_ids: Tensor, ch, c: int, store, train: bool, group,
                          device: torch.device, temperature: float, entropy: bool, vision=None
                          ) -> tuple[Tensor, Tensor | None]:
    """Chunk ``c`` (a :class:`flexgroup.stream.plan.ChunkPlan`) on this rank's slice.

    Args:
        input_ids: the plan's trie row [L]; the chunk's tokens are ``input_ids[ch.tokens]`` [Q].
        vision: the call's :class:`flexgroup.stream.vision.StreamVision`, or None: with it the slice runs as
            ``inputs_embeds`` with its placeholders' features (every rank holds every item's features; each
            rank's leaves get the gradient of its own tokens, so summed over ranks the tower's is whole).

    Returns:
        the log-probs the chunk produces, [len(ch.produced)], summed over the group (so whole on every
        rank; graph attached when training), and their entropies [len(ch.produced)] (detached) or None.
    """
    ids = input_ids[ch.tokens]                                             # [Q]
    shard = row_shard(ch.row_layout, ids, group, checked=True)            # padded row of Qp tokens; check_call ran
    row = shard.layout
    Q, pad = ids.numel(), row.num_tokens - ids.numel()
    ctx = ShardedChunkContext(c, _padded(ch.layout, pad), ch.n_context, ch.context, ch.keep, store, train,
                              ch.pieces, ch.external + [-1] * (pad > 0), group=group)
    lo, hi = shard.start, shard.stop
    ids_p = torch.cat([ids, ids.new_zeros(pad)])
    pos_p = torch.cat([ch.positions, row.position_ids[Q:]])                # true positions, then the padding's
    rows = ch.logit_rows                                                   # [K] chunk rows whose logits are read
    local = rows[(rows >= lo) & (rows < hi)] - lo                          # [K_r] this rank's
    keep = local if local.numel() else torch.zeros(1, dtype=torch.long)
    mask = StreamMask(row, device, ctx, shard=shard, sequence_ends=ch.row_layout.leaf_ends)
    if vision is not None:
        tokens = torch.cat([ch.tokens, ch.tokens.new_full((pad,), -1)])[lo:hi]
        logits = vision.forward(model, tokens, ids_p[lo:hi], pos_p[lo:hi], row, mask, keep, device)
    else:
        out = model(input_ids=ids_p[lo:hi].to(device)[None],
                    position_ids=tag_position_ids(pos_p[lo:hi].to(device)[None], row),
                    attention_mask=mask, use_cache=False, logits_to_keep=keep.to(device))
        logits = out.logits[0]                                             # [K_r, V]
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    P = ch.produced.numel()
    # a rank's backward must reach every all-to-all of its graph, also where it scores nothing here: the
    # empty slice's sum is an exact 0 that connects the log-probs to this rank's logits
    lp = logits.new_zeros(P) + (logits[:0].sum() if torch.is_grad_enabled() else 0.0)
    ent = logits.new_zeros(P) if entropy else None
    if P:
        pred = rows[ch.produced_rows]                                      # [P] chunk row of each predecessor
        own = torch.nonzero((pred >= lo) & (pred < hi))[:, 0]
        if own.numel():
            at = torch.searchsorted(local, pred[own] - lo)
            plan = read_plan(at, input_ids[ch.produced[own]], logits.device)  # folded where the indices are
            lp_own, ent_own = read_scores(logits, plan, temperature, entropy)
            own = own.to(logits.device)
            lp = lp.index_put((own,), lp_own)
            if entropy:
                ent = ent.index_put((own,), ent_own.detach())
    lp = sum_over_ranks(lp, group)
    if ent is not None:
        ent = sum_over_ranks(ent, group)
    return lp, ent


def sharded_row(model: torch.nn.Module, batch, group, device: torch.device, temperature: float,
                entropy: bool) -> tuple[Tensor, Tensor | None]:
    """A packed row (a tree that fits the budget) sharded over ``group``: its ``[n, T]`` log-probs (and
    entropies, detached, or None) summed over the group, as :func:`sharded_chunk_forward` returns them."""
    out = model(**batch.model_inputs(device, needed_logits_only=True, shard=group))
    res = batch.logprobs(out.logits, temperature=temperature, return_entropy=entropy, shard=group)
    lp, ent = res if entropy else (res, None)
    if torch.is_grad_enabled():
        lp = lp + out.logits.reshape(-1)[:0].sum()   # see sharded_chunk_forward: reach every all-to-all
    return sum_over_ranks(lp, group), (None if ent is None else sum_over_ranks(ent.detach(), group))
