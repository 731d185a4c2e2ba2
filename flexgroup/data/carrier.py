"""The grouped-mask carrier: how a packed layout reaches attention inside an unmodified model.

:class:`GroupedMask` is a storage-less tensor of shape ``(1, 1, L, L)`` given to the model as
``attention_mask``. transformers passes a 4-D mask through unchanged, so flexgroup's registered
attention function receives the object intact and reads its :class:`~flexgroup.layout.Layout`. Any
*other* attention code that touches it (stock sdpa, eager, flash, HF flex) performs a tensor op on
it, and every op raises: an unpatched model given grouped inputs can never return numbers. Only
``.to(device)``, ``.detach()``, ``.clone()`` and ``copy.deepcopy`` -- what generic code does to a whole
inputs dict -- return a carrier of the same layout (which still raises on any other op).

The carrier also holds the per-forward plan cache: the kernels' plans (block masks, gather indices)
are built by the first layer of a forward that needs them and reused by every other layer and by the
backward; the model-level hook calls :meth:`GroupedMask.new_forward` at the start of each forward,
so a user pattern whose behaviour changed between forwards is planned anew.

No transformers import here (data layer).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..layout.checks import normal_tensors
from ..layout import Layout

__all__ = ["GroupedMask", "tag_position_ids", "tagged_layout"]


# ops a user applies to a whole inputs dict (attention code never does; HF's flex path aliases the mask,
# which must keep raising)
_SAME_CARRIER = (torch.ops.aten.detach.default, torch.ops.aten.clone.default)


class GroupedMask(torch.Tensor):
    """Storage-less ``(1, 1, L, L)`` bool tensor that carries a :class:`Layout` to attention.

    Only flexgroup's attention function reads it (through ``.grouped_layout``); every tensor operation on it
    raises, so attention code that is not flexgroup's cannot silently use it as a causal mask.

    It also carries the batch's sequences, ``sequence_ends`` (the packed index of each sequence's last
    token; a sequence may end inside a segment, see :meth:`Layout.sequence_lengths`), from which the
    model-level guards take every per-sequence fact (lengths, per-token sequence counts). Default: the
    layout's root-to-leaf paths.
    """

    grouped_layout: Layout
    sequence_ends: tuple[int, ...]
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, layout: Layout, device: torch.device | str = "cpu", shard=None,
                sequence_ends: "tuple[int, ...] | None" = None) -> "GroupedMask":
        # shard: a flexgroup.data.sharding.RowShard (sequence parallelism): ``layout`` is then the padded row of
        # all ranks and the carrier's shape (1, 1, this rank's tokens, Lp)
        if not isinstance(layout, Layout):
            raise TypeError(f"GroupedMask carries a flexgroup.Layout, got {type(layout).__name__}")
        L = layout.num_tokens
        Lq = L if shard is None else shard.local_tokens
        t = torch.Tensor._make_wrapper_subclass(cls, (1, 1, Lq, L), dtype=torch.bool, device=torch.device(device))
        t.grouped_layout = layout
        t.shard = shard
        t.sequence_ends = layout.leaf_ends if sequence_ends is None else tuple(int(e) for e in sequence_ends)
        t._plans = {}
        t._counts = None
        return t

    @property
    def local_tokens(self) -> int:
        """Tokens of the row this process computes (all ``L``; this rank's slice when sharded)."""
        return self.shape[-2]

    def sequence_lengths(self) -> list[int]:
        """Tokens of each sequence of the batch (see :meth:`Layout.sequence_lengths`)."""
        return self.grouped_layout.sequence_lengths(self.sequence_ends)

    @normal_tensors
    def sequence_counts(self) -> torch.Tensor:
        """LongTensor [L] on CPU: how many of the batch's sequences contain each token (computed once)."""
        if self._counts is None:
            self._counts = self.grouped_layout.sequence_counts(self.sequence_ends)
        return self._counts

    def new_forward(self) -> None:
        """Forget the plans of the previous forward (called by the model-level hook)."""
        self._plans.clear()

    @normal_tensors  # a plan may serve the backward of a forward run with gradients
    def plan(self, key: tuple, build: Callable[[], object]) -> object:
        """The plan stored under ``key`` in this forward, built by ``build()`` on first use."""
        p = self._plans.get(key)
        if p is None:
            p = self._plans[key] = build()
        return p

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype", torch.bool) == torch.bool:
            # moving the carrier to another device (``{k: v.to(dev)}``) keeps it a carrier
            return GroupedMask(args[0].grouped_layout, kwargs.get("device") or args[0].device, args[0].shard,
                               sequence_ends=args[0].sequence_ends)
        if func in _SAME_CARRIER:
            # .detach() / .clone() of the whole mask (what generic input code does to every tensor) carry the
            # same layout: the result is the carrier again, and still raises on any other use
            return GroupedMask(args[0].grouped_layout, args[0].device, args[0].shard,
                               sequence_ends=args[0].sequence_ends)
        raise RuntimeError(
            f"grouped inputs reached attention code that is not flexgroup's ({func}): call "
            "flexgroup.patch(model) first, and do not switch the model's attention implementation "
            "afterwards (flash / sdpa / eager / flex_attention would treat the packed row as one "
            "causal sequence and return wrong numbers)"
        )

    def __repr__(self) -> str:  # the default repr would run tensor ops
        shard = "" if self.shard is None else f", shard={self.shard.describe()}"
        return f"GroupedMask({self.grouped_layout!r}, device={self.device}{shard})"

    def __deepcopy__(self, memo):
        return GroupedMask(self.grouped_layout, self.device, self.shard, self.sequence_ends)

    def __reduce_ex__(self, proto):
        return (GroupedMask, (self.grouped_layout, str(self.device), self.shard, self.sequence_ends))


class _Tag:
    """What :func:`tag_position_ids` attaches: the layout, the tensor's version counter when tagged and
    its values then. ``copy.deepcopy`` of the tensor copies the tag as a *copy's* tag (version None), and so
    does pickling (``torch.save`` / ``torch.load`` of ``model_inputs()``): a copy or a loaded tensor has a
    version counter of its own, so it is checked by value instead."""

    __slots__ = ("layout", "version", "values")

    def __init__(self, layout: Layout, version: int | None, values: torch.Tensor):
        self.layout, self.version, self.values = layout, version, values

    def __deepcopy__(self, memo) -> "_Tag":
        return _Tag(self.layout, None, self.values)

    def __reduce__(self):
        return _Tag, (self.layout, None, self.values)


_EDITED = ("the grouped position_ids from batch.model_inputs() were modified in place: RoPE would see wrong "
           "positions. Do not edit the tensors model_inputs() returns; call model_inputs() again for fresh ones")


def tag_position_ids(position_ids: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Mark ``position_ids`` as grouped (so a patched model can tell when the GroupedMask is missing).

    The tag also records the tensor's version counter (bumped by every in-place operation), so that
    an in-place edit of the returned tensor is detected by :func:`tagged_layout` -- in O(1), with no
    host sync -- instead of silently feeding RoPE wrong positions. A ``copy.deepcopy`` of the tensor
    (e.g. of the whole ``model_inputs()`` dict) stays tagged and is checked against the values it
    was tagged with. So is a tensor made under ``torch.inference_mode()``: inference tensors keep no
    version counter.
    """
    version = None if position_ids.is_inference() else position_ids._version
    position_ids._flexgroup_tag = _Tag(layout, version, position_ids.detach().clone())
    return position_ids


def tagged_layout(position_ids) -> Layout | None:
    """The layout ``position_ids`` was tagged with, or None; ValueError if it was edited in place since."""
    tag = getattr(position_ids, "_flexgroup_tag", None)
    if tag is None:
        return None
    if tag.version is None or position_ids.is_inference():  # a deep copy or an inference tensor: compare values
        same = position_ids.shape == tag.values.shape and torch.equal(position_ids.detach(),
                                                                       tag.values.to(position_ids.device))
        if not same:
            raise ValueError(_EDITED)
    elif position_ids._version != tag.version:
        raise ValueError(_EDITED)
    return tag.layout
