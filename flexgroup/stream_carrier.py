"""The carrier of a streamed chunk: its layout, and the keys and values kept from earlier chunks.

:class:`StreamMask` is a :class:`~flexgroup.carrier.GroupedMask` (storage-less, every tensor op
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

from .carrier import GroupedMask
from .kernels.kept import attend_with_context, plan_suffix
from .layout import Layout

__all__ = ["KeptStore", "ChunkContext", "StreamMask"]


class KeptStore:
    """Kept K/V leaves of one streamed call: ``kv[(attention module id, piece)] = (k, v)`` [1, Hkv, n, D],
    and per chunk the ``(original, leaf)`` pairs whose gradient its pending backward passes on."""

    def __init__(self):
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.originals: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def release(self, chunk: int, pieces) -> None:
        """Forget what ``chunk`` kept (after its backward: every reader has run)."""
        self.originals.pop(chunk, None)
        pieces = set(pieces)
        for key in [k for k in self.kv if k[1] in pieces]:
            del self.kv[key]


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
                 keep: list[tuple[int, int, int]], store: KeptStore, train: bool):
        self.chunk, self.layout, self.n_context, self.context = chunk, layout, n_context, context
        self.keep, self.store, self.train = keep, store, train
        self._recorded: set[int] = set()
        self._plans: dict = {}

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
        if m not in self._recorded:
            self._recorded.add(m)
            self._record(m, key, value)
        kc = vc = None
        if self.context:
            try:
                kv = [self.store.kv[(m, p)] for p in self.context]
            except KeyError:
                raise RuntimeError(f"flexgroup.stream_backward: {type(module).__name__} has no kept keys/values from "
                                   "the earlier chunk of this chunk's prefix (did the model skip the layer in that "
                                   "forward?); please report it") from None
            kc = torch.cat([k for k, _ in kv], 2)
            vc = torch.cat([v for _, v in kv], 2)
        pkey = (pattern, score_mod, query.device)
        plan = self._plans.get(pkey)
        if plan is None:
            plan = self._plans[pkey] = plan_suffix(self.layout, self.n_context, pattern, score_mod, query.device)
        return attend_with_context(plan, query, key, value, kc, vc, scale)

    def _record(self, m: int, key: torch.Tensor, value: torch.Tensor) -> None:
        originals = self.store.originals.setdefault(self.chunk, [])
        for piece, a, n in self.keep:
            pair = []
            for orig in (key[:, :, a:a + n], value[:, :, a:a + n]):
                leaf = orig.detach()
                if self.train and orig.requires_grad:
                    leaf.requires_grad_()
                    originals.append((orig, leaf))
                pair.append(leaf)
            self.store.kv[(m, piece)] = (pair[0], pair[1])


class StreamMask(GroupedMask):
    """A :class:`GroupedMask` over a chunk's own row that also carries its :class:`ChunkContext` (``.stream``)."""

    stream: ChunkContext

    @staticmethod
    def __new__(cls, row_layout: Layout, device: torch.device | str, stream: ChunkContext) -> "StreamMask":
        t = GroupedMask.__new__(cls, row_layout, device)
        t.stream = stream
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype", torch.bool) == torch.bool:
            # keep the chunk context when moved: a plain GroupedMask would attend without the kept keys
            return StreamMask(args[0].grouped_layout, kwargs.get("device") or args[0].device, args[0].stream)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def __repr__(self) -> str:
        return f"StreamMask(chunk {self.stream.chunk}, {self.grouped_layout!r}, device={self.device})"

    def __deepcopy__(self, memo):
        return StreamMask(self.grouped_layout, self.device, self.stream)

    def __reduce_ex__(self, proto):
        raise TypeError("a StreamMask (a chunk of flexgroup.stream_backward) holds live tensors and cannot be pickled")
