"""The carrier of a streamed chunk: its layout, and the keys and values kept from earlier chunks.

:class:`StreamMask` is a :class:`~flexgroup.data.carrier.GroupedMask` (storage-less, every tensor op
raises) whose ``grouped_layout`` is the chunk's own row (what the model's per-forward checks see)
and whose ``stream`` is a :class:`ChunkContext`. flexgroup's attention function hands a layer's
``q, k, v`` (after RoPE) to :meth:`ChunkContext.attend`, which

- on the layer's first call in this forward *records* the keys and values of the chunk's pieces that
  later chunks read: the slices of ``k``/``v`` (graph attached, the *originals*) and detached copies
  that require grad (the *leaves*, in a :class:`KeptStore` shared by the whole call);
- attends the chunk's queries to ``[leaves of its context pieces ; own k/v]``
  (:mod:`flexgroup.kernels.kept`).

Gradients of later chunks accumulate in the leaves' ``.grad``; the streaming driver
(:mod:`flexgroup.stream`) then runs ``torch.autograd.backward(originals, [leaf.grad ...])`` once.
A recomputation of the layer (non-reentrant gradient checkpointing) finds the layer already recorded
and only attends again, to the same leaves. No global state: everything hangs off the carrier.

No transformers import here (data layer).
"""

from __future__ import annotations

import torch

from ..data.carrier import GroupedMask
from ..kernels.kept import attend_with_context, plan_suffix
from ..layout import Layout

__all__ = ["KeptStore", "ChunkContext", "StreamMask"]


class KeptStore:
    """Kept leaves of one streamed call, and per chunk the ``(original, leaf)`` pairs whose gradient its
    pending backward passes on.

    ``kv[(piece, attention module id)] = (k, v)`` [1, Hkv, n, D]; hybrid mixers keep
    ``kept[(piece, mixer module id, "state")]`` (the recurrent state after the piece) and
    ``kept[(piece, mixer module id, "conv")]`` [k - 1, C] (the last conv inputs of its path).
    """

    def __init__(self):
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.kept: dict[tuple, torch.Tensor] = {}
        self.originals: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def keep(self, chunk: int, key: tuple, orig: torch.Tensor, train: bool) -> torch.Tensor:
        """Store a detached leaf of ``orig`` under ``key`` (requiring grad when training); return it."""
        leaf = orig.detach()
        if train and orig.requires_grad:
            leaf.requires_grad_()
            self.originals.setdefault(chunk, []).append((orig, leaf))
        self.kept[key] = leaf
        return leaf

    def release(self, chunk: int, pieces) -> None:
        """Forget what ``chunk`` kept (after its backward: every reader has run)."""
        self.originals.pop(chunk, None)
        pieces = set(pieces)
        for d in (self.kv, self.kept):
            for key in [k for k in d if k[0] in pieces]:
                del d[key]


class ChunkContext:
    """What one chunk's attention layers need beyond their own ``q, k, v``.

    Args:
        chunk: the chunk's index (keys of ``store.originals``).
        layout: Layout over ``context pieces + own pieces`` (true virtual positions).
        n_context: tokens of kept context at the front of ``layout``.
        context: piece ids of the context, in ``layout`` order.
        keep: ``(piece, local start, length)`` of own pieces to keep for later chunks.
        store: the call's :class:`KeptStore`.
        train: whether gradients flow (leaves require grad and originals are recorded).
    """

    def __init__(self, chunk: int, layout: Layout, n_context: int, context: list[int],
                 keep: list[tuple[int, int, int]], store: KeptStore, train: bool,
                 pieces: list[int] | None = None, external: list[int] | None = None):
        self.chunk, self.layout, self.n_context, self.context = chunk, layout, n_context, context
        self.keep, self.store, self.train = keep, store, train
        self.pieces, self.external = pieces or [], external or []  # own pieces; their parents in earlier chunks
        self._recorded: set = set()
        self._plans: dict = {}

    def first_call(self, key) -> bool:
        """True the first time ``key`` (a module and what it keeps) asks in this chunk (not on recomputation)."""
        if key in self._recorded:
            return False
        self._recorded.add(key)
        return True

    def cached(self, key, build):
        """A per-chunk plan stored under ``key``, built by ``build()`` on first use."""
        p = self._plans.get(key)
        if p is None:
            p = self._plans[key] = build()
        return p

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               pattern, score_mod, scale: float) -> torch.Tensor:
        """q [1, Hq, Q, D], k/v [1, Hkv, Q, D] (RoPE applied) -> [1, Hq, Q, D] over context + own keys."""
        if self.train and not torch.is_grad_enabled():
            raise RuntimeError(
                "flexgroup.stream_backward: an attention layer ran without autograd inside a training chunk. "
                "Reentrant gradient checkpointing does that, and the kept keys and values of the shared prefix "
                "would get no gradient: use gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False}) (transformers' default)")
        m = id(module)
        if self.first_call(m):
            self._record(m, key, value)
        try:
            kv = [self.store.kv[(p, m)] for p in self.context]
        except KeyError:
            raise RuntimeError(f"flexgroup.stream_backward: {type(module).__name__} has no kept keys/values from "
                               "the earlier chunk of this chunk's prefix (did the model skip the layer in that "
                               "forward?); please report it") from None
        plan = self.cached((pattern, score_mod, query.device),
                           lambda: plan_suffix(self.layout, self.n_context, pattern, score_mod, query.device))
        return attend_with_context(plan, query, key, value, [k for k, _ in kv], [v for _, v in kv], scale)

    def mixer_fork(self, mask: GroupedMask, where: str, module: torch.nn.Module):
        """The fork of a hybrid's stateful ``module`` in this chunk: its roots continue from the kept states and
        conv rows of earlier chunks (:class:`flexgroup.stream.hybrid_fork.StreamFork`, asked for by
        :mod:`flexgroup.patches.hybrid` as :meth:`attend` is by the attention function)."""
        from .hybrid_fork import StreamFork  # noqa: PLC0415  (it imports the patches layer; dense models never ask)

        return StreamFork(mask, where, self, module)

    def _record(self, m: int, key: torch.Tensor, value: torch.Tensor) -> None:
        for piece, a, n in self.keep:
            k = self.store.keep(self.chunk, (piece, m, "k"), key[:, :, a:a + n], self.train)
            v = self.store.keep(self.chunk, (piece, m, "v"), value[:, :, a:a + n], self.train)
            self.store.kv[(piece, m)] = (k, v)


class StreamMask(GroupedMask):
    """A :class:`GroupedMask` over a chunk's own row that also carries its :class:`ChunkContext` (``.stream``)."""

    stream: ChunkContext

    @staticmethod
    def __new__(cls, row_layout: Layout, device: torch.device | str, stream: ChunkContext, shard=None,
                sequence_ends=None) -> "StreamMask":
        # shard: this rank's RowShard of the padded chunk row (streaming on a sequence-parallel model,
        # flexgroup.stream.shard); row_layout is then the padded row
        t = GroupedMask.__new__(cls, row_layout, device, shard, sequence_ends)
        t.stream = stream
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype", torch.bool) == torch.bool:
            # keep the chunk context when moved: a plain GroupedMask would attend without the kept keys
            m = args[0]
            return StreamMask(m.grouped_layout, kwargs.get("device") or m.device, m.stream, m.shard, m.sequence_ends)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def __repr__(self) -> str:
        return f"StreamMask(chunk {self.stream.chunk}, {self.grouped_layout!r}, device={self.device})"

    def __deepcopy__(self, memo):
        return StreamMask(self.grouped_layout, self.device, self.stream, self.shard, self.sequence_ends)

    def __reduce_ex__(self, proto):
        raise TypeError("a StreamMask (a chunk of flexgroup.stream_backward) holds live tensors and cannot be pickled")
