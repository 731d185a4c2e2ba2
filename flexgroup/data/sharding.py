"""Sharding a packed row across the ranks of a sequence-parallel group (Ulysses), data side.

A row of ``L`` tokens is padded to ``Lp = W * ceil(L / W)`` tokens for a group of ``W`` ranks; rank
``r`` holds the contiguous slice ``[r * c, (r + 1) * c)``, ``c = Lp / W``. The padding is one extra
root segment ``Layout.tree([-1], [Lp - L])`` packed after the row (virtual positions ``0 ..
Lp - L - 1``): it is a tree of its own, so no real token attends to it and no hybrid state flows
into or out of it -- padding cannot change a real token's numbers. The padded layout is what every
rank's attention and state forking see after the all-to-all; the carrier
(:class:`flexgroup.data.carrier.GroupedMask`) holds it together with the :class:`RowShard`.

Log-probs: a scored token belongs to the rank that holds the logit row *predicting* it (the path's
previous token), so each rank reads only its own logits, no logit row crosses ranks, and the sum
of the ranks' ``[N, T]`` log-probs is the unsharded ``batch.logprobs`` (every token counted once).
The first token of a response, predicted from the prompt's last position, belongs to the rank that
holds that position, wherever the response's own tokens sit.

No transformers import here (data layer).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..layout.checks import normal_tensors
from ..layout import Layout
from .agreement import Fingerprint

__all__ = ["RowShard", "row_shard", "sharded_inputs", "rank_rows", "rank_read_index", "note_inputs",
           "logit_read_index"]


@dataclass(frozen=True, eq=False)
class RowShard:
    """This rank's slice of a padded packed row.

    Attributes:
        group: the ``torch.distributed`` process group the row is sharded over.
        rank, world: this rank's index in ``group`` and the group's size ``W``.
        num_tokens: ``L``, real tokens of the row; ``layout.num_tokens`` is the padded ``Lp``.
        layout: the padded :class:`Layout` (``Lp`` tokens, a multiple of ``W``).
        start, stop: this rank's tokens ``[start, stop)`` of the padded row; ``stop - start = Lp / W``.
        agreement: the :class:`flexgroup.data.agreement.Fingerprint` of the batch (padded layout, the whole
            row's token ids, loss masks, visual inputs) that every rank of the group must hold the same, checked
            once per forward by the patched model before its first collective; None for a streamed chunk (the
            streamed call was checked as a whole, :mod:`flexgroup.stream.shard`).
    """

    group: object
    rank: int
    world: int
    num_tokens: int
    layout: Layout
    start: int
    stop: int
    agreement: Fingerprint | None

    @property
    def local_tokens(self) -> int:
        return self.stop - self.start

    def describe(self) -> str:
        return (f"rank {self.rank} of {self.world}: tokens [{self.start}, {self.stop}) of a row of {self.num_tokens} "
                f"tokens padded to {self.layout.num_tokens}")


def group_rank_world(group, arg: str = "shard=") -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group``; ValueError, naming the argument ``arg``, if it is
    not a usable process group (also the check of ``patch(sequence_parallel=group)``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{arg}group needs an initialised torch.distributed process group "
                         "(torch.distributed.init_process_group(...) first; launch with torchrun)")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{arg} takes a torch.distributed ProcessGroup (e.g. dist.group.WORLD or "
                         f"device_mesh['sp'].get_group()), got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{arg}group: this process is not a member of the group it was given")
    return rank, dist.get_world_size(group)


def row_shard(layout: Layout, input_ids: torch.Tensor, group, *, loss_masks: torch.Tensor | None = None,
              visual=None, checked: bool = False) -> RowShard:
    """The :class:`RowShard` of this process for the row ``(layout, input_ids [L])`` over ``group``.

    ``loss_masks`` ([N, T] bool) and ``visual`` (the batch's visual inputs) join the layout and ids in the
    fingerprint the ranks compare; ``checked``: the caller compared them already (a streamed chunk).
    """
    rank, world = group_rank_world(group)
    padded = layout.padded(world)
    c = padded.num_tokens // world
    agreement = None if checked else Fingerprint.of(
        call="forward", layout=(padded.parents, padded.lengths), input_ids=input_ids, loss_masks=loss_masks,
        visual=visual)
    return RowShard(group, rank, world, layout.num_tokens, padded, rank * c, (rank + 1) * c, agreement)


def padded_tensor(x: torch.Tensor, shard: RowShard, fill: int = 0) -> torch.Tensor:
    """``x`` [..., L] extended with ``fill`` to the padded row [..., Lp] (input ids; the padded row's
    virtual positions are ``shard.layout.position_ids``)."""
    pad = shard.layout.num_tokens - x.shape[-1]
    return x if pad == 0 else torch.cat([x, x.new_full(x.shape[:-1] + (pad,), fill)], -1)


def sharded_inputs(batch, device: torch.device, needed_logits_only: bool, group) -> dict:
    """``batch.model_inputs(device, shard=group)`` of a GroupedBatch: this rank's slice of the padded row.

    ``input_ids`` and ``position_ids`` [1, Lp / W], the carrier of the whole padded layout with this
    rank's :class:`RowShard`, ``use_cache=False``; with ``needed_logits_only``, ``logits_to_keep`` = the
    local indices of this rank's logit rows that ``batch.logprobs`` reads.
    """
    from .carrier import GroupedMask, tag_position_ids

    sh = row_shard(batch.layout, batch.input_ids, group, loss_masks=batch.response_mask)
    note_inputs(batch, (sh.rank, sh.world) if sh.world > 1 else None)  # a group of 1 reads as unsharded
    pos = sh.layout.position_ids[sh.start:sh.stop].to(device, copy=True)[None]   # copies: never the batch's own
    out = {
        "input_ids": padded_tensor(batch.input_ids, sh)[sh.start:sh.stop].to(device, copy=True)[None],
        "position_ids": tag_position_ids(pos, sh.layout),
        "attention_mask": GroupedMask(sh.layout, device, sh, batch.sequence_ends),  # padding is no sequence
        "use_cache": False,
    }
    if needed_logits_only:
        out["logits_to_keep"] = rank_rows(batch, group)[0].to(device, copy=True)   # the cached rows stay intact
    return out


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # batch -> {(rank, world, ...): index}


@normal_tensors
def _cached(batch, key: tuple, build):
    per = _CACHE.setdefault(batch, {})
    if key not in per:
        per[key] = build()
    return per[key]


def rank_rows(batch, group) -> tuple[torch.Tensor, int]:
    """``(kept [K_r], c)``: the local indices of this rank's logit rows that ``batch.logprobs`` reads, and
    the rank's row count ``c = Lp / W``."""
    return _rank_rows(batch, *group_rank_world(group))


def _rank_rows(batch, rank: int, world: int) -> tuple[torch.Tensor, int]:
    def build():
        c = batch.layout.padded(world).num_tokens // world
        rows = batch.logit_rows
        return rows[(rows >= rank * c) & (rows < (rank + 1) * c)] - rank * c, c

    return _cached(batch, ("rows", rank, world), build)


def rank_read_index(batch, device: torch.device, group, needed_only: bool) -> tuple:
    """This rank's part of ``batch.read_index``: the scored tokens whose predicting logit row it holds.

    Returns ``(pred [T_r], targets [T_r], flat [T_r])`` on ``device``: the local logit row of each (its
    row among :func:`rank_rows`' kept ones when ``needed_only``), the tokens, their flat output indices.
    """
    rank, world = group_rank_world(group)

    def build():
        pred_all, targets, flat = batch.read_index(torch.device("cpu"))
        kept, c = rank_rows(batch, group)
        own = (pred_all >= rank * c) & (pred_all < (rank + 1) * c)
        pred = pred_all[own] - rank * c
        if needed_only:
            pred = torch.searchsorted(kept, pred)
        return pred.to(device), targets[own].to(device), flat[own].to(device)

    return _cached(batch, ("index", rank, world, needed_only, str(device)), build)


# ------------------------------------------------------------------ which forward a read belongs to
# A rank's logits of a sharded forward have c = Lp / W rows (or K_r, needed rows only); an unsharded
# forward's have L (or K). A count that fits the other kind of forward would be read as it -- silently
# wrong log-probs -- so each batch remembers the kinds of inputs made from it: None for model_inputs(),
# (rank, world) for model_inputs(shard=group). The memory is an attribute of the batch, so that a copy
# (copy.deepcopy, pickle) remembers it too: a copy's reads are checked like the original's.
_MADE = "_flexgroup_inputs_made"


def note_inputs(batch, kind: "tuple[int, int] | None") -> None:
    """Record that ``batch.model_inputs`` made inputs of ``kind`` (see above)."""
    batch.__dict__.setdefault(_MADE, set()).add(kind)


def _counts(batch, kind) -> tuple[int, ...]:
    """Logit rows of a forward of ``kind``: (every position, needed rows only[, the LM head's padded rows])."""
    if kind is None:
        return batch.num_tokens, batch.logit_rows.numel(), batch.head_rows.numel()
    kept, c = _rank_rows(batch, *kind)
    return c, kept.numel()


def _where(kind) -> str:
    return "model_inputs() (unsharded)" if kind is None else (f"model_inputs(shard=group) on rank {kind[0]} of "
                                                              f"{kind[1]}")


def logit_read_index(batch, logits: torch.Tensor, shard, device: torch.device | None = None) -> tuple:
    """``(pred [T], targets [T], flat [T])`` on ``device`` (default the logits') to read ``logits`` [n, V]
    (:meth:`GroupedBatch.read_index`, or :func:`rank_read_index` with ``shard``), after checking that ``n`` fits the forward the read names
    (``shard=group``: this rank's slice; none: the whole row) and no *other* kind of forward this batch made
    inputs for on this process (a rank's logits read without ``shard=``, or the reverse, would be read at
    the wrong rows): ValueError naming ``shard=`` otherwise."""
    kind = None if shard is None else group_rank_world(shard)
    kind = None if kind is None or kind[1] == 1 else kind  # a group of 1 reads the same rows as no group
    made = batch.__dict__.get(_MADE, set())
    n = logits.shape[0] if logits.ndim == 2 else -1
    counts = _counts(batch, kind)
    full, needed = counts[:2]
    others = sorted((k for k in made if k != kind), key=str)
    clash = [k for k in others if n in _counts(batch, k)]
    if clash or (others and n not in counts):
        fits = f" -- {n} rows is what {_where(clash[0])} gives" if clash else ""
        fix = ("pass the group given to model_inputs: batch.logprobs(logits, shard=group)" if shard is None else
               "give logprobs the shard= given to model_inputs (none for an unsharded forward)")
        raise ValueError(f"logprobs{'' if shard is None else '(shard=group)'}: logits {tuple(logits.shape)} read as "
                         f"from {_where(kind)}, but this batch's inputs were made with "
                         f"{' and '.join(map(_where, sorted(made, key=str)))}{fits}; read at the wrong rows they would "
                         f"give wrong log-probs: {fix} (one GroupedBatch per kind of forward to use both)")
    if n not in counts:
        what = "this rank's slice" if shard is not None else "every position"
        kept = f"[1, {counts[-1]}, V] (needed_logits_only=True)" + (
            f" or [1, {needed}, V] (the logit_rows)" if counts[-1] != needed else "")
        raise ValueError(f"logprobs: expected logits [1, {full}, V] ({what}) or {kept}, got {tuple(logits.shape)}"
                         + ("" if shard is not None else "; a sequence-parallel rank's logits need shard=group"))
    needed_only = n != full  # the K needed rows come first among the head's K' (GroupedBatch.head_rows)
    device = logits.device if device is None else device
    if shard is None:
        return batch.read_index(device, needed_only)
    return rank_read_index(batch, device, shard, needed_only)
