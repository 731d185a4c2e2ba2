"""State forking for a streamed chunk of a hybrid (:func:`flexgroup.stream_backward`).

A chunk's row cuts some segments from their parents, which ran in an earlier chunk. Exactly as
:mod:`flexgroup.patches.hybrid` forks the state at a branch inside one row, such a segment must start

- its **recurrent scan** from the parent's final state: kept by the parent's chunk as a leaf that
  requires grad (``store.kept[(piece, mixer, "state")]``, [H, ...] as the scan returns it);
- its **causal conv** after the last ``k - 1`` conv inputs of its path: kept likewise
  (``store.kept[(piece, mixer, "conv")]`` [k - 1, C]; fewer real rows near a root, zeros before).

:class:`StreamFork` is the :class:`~flexgroup.patches.hybrid.Fork` of such a chunk (the chunk makes it,
:meth:`flexgroup.stream.chunk_carrier.ChunkContext.mixer_fork`, when a mixer asks): its plan
appends the kept conv rows after the row's zero row and points the cut segments' conv context at
them; its states start depth-0 segments with an outside parent from the kept states and record, on
the mixer's first call in the chunk, the final state and last conv inputs of every piece that a
later chunk continues. Gradients reach the kept leaves; the chunk's pending backward passes them on
with the attention's kept keys and values (:mod:`flexgroup.stream.chunk_carrier`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.carrier import GroupedMask
from ..kernels.fork import ForkPlan, ForkStates, Level, conv_context
from ..layout import Layout
from ..patches.hybrid import Fork

__all__ = ["StreamFork"]


@dataclass(frozen=True, eq=False)
class _ConvPlan:
    plan: ForkPlan          # the row's plan, cut roots' conv context pointing at the appended kept rows
    external: list[int]     # kept pieces whose conv rows are appended, in order
    keep_index: torch.Tensor  # [n_keep, k - 1] rows of the extended input: the last conv inputs of each kept piece


class StreamFork(Fork):
    """The fork of one mixer call inside a streamed chunk (``stream`` a ``ChunkContext``)."""

    def __init__(self, mask: GroupedMask, where: str, stream, module: torch.nn.Module):
        super().__init__(mask, where)
        self.layout: Layout = mask.grouped_layout
        self.stream, self.m = stream, id(module)

    # ------------------------------------------------------------------ conv
    def plan(self, conv_kernel: int, x: torch.Tensor, dim: int) -> ForkPlan:
        base = super().plan(conv_kernel, x, dim)
        if conv_kernel == 1:
            return base
        return self._conv_plan(base, conv_kernel, x.device).plan

    def _conv_plan(self, base: ForkPlan, k: int, device) -> _ConvPlan:
        return self.stream.cached(("conv", k, str(device)), lambda: _extend(base, self.layout, self.stream, k, device))

    def conv_input(self, x: torch.Tensor, plan: ForkPlan) -> torch.Tensor:
        k = next(lv.conv_index.shape[1] - lv.token_index.shape[1] for lv in plan.levels) + 1
        cp = self._conv_plan(None, k, x.device)
        kept = self.stream.store.kept
        if cp.external:
            x = torch.cat([x] + [kept[(p, self.m, "conv")].to(x.dtype) for p in cp.external], 0)
        # gathered on every call, kept on the first: a checkpoint recomputation must save the same tensors
        rows = [x[idx] for idx in cp.keep_index]
        if self.stream.first_call((self.m, "conv")):
            for (piece, _, _), r in zip(self.stream.keep, rows):
                self.stream.store.keep(self.stream.chunk, (piece, self.m, "conv"), r, self.stream.train)
        return x

    # ------------------------------------------------------------------ recurrent state
    def states(self) -> ForkStates:
        return _StreamStates(self, self.stream.first_call((self.m, "state")))


def _extend(base: ForkPlan, layout: Layout, stream, k: int, device) -> _ConvPlan:
    """``base`` with each segment's conv context continued, past its row's root, into the kept rows of the
    root's parent (appended after the zero row ``L``)."""
    ctx, L = k - 1, layout.num_tokens
    seg = layout.seg_id
    external = sorted({p for p in stream.external if p >= 0})
    slot = {p: L + 1 + j * ctx for j, p in enumerate(external)}
    levels, windows = [], {}
    for lv in base.levels:
        conv = lv.conv_index.clone().cpu()
        for r, s in enumerate(seg[lv.token_index[:, 0].cpu()].tolist()):
            before = conv_context(layout, s, ctx)
            need = ctx - len(before)
            outside = stream.external[layout.component[s]]
            if need and outside >= 0:  # the path continues in an earlier chunk: its kept last conv inputs
                conv[r, :need] = torch.arange(slot[outside] + ctx - need, slot[outside] + ctx)
            n_own = int((lv.token_index[r] < L).sum())
            windows[s] = conv[r, n_own: n_own + ctx]  # the last ctx conv inputs of the path through s
        levels.append(Level(lv.depth, conv.to(device), lv.token_index, lv.parent_rows))
    keep = [windows[stream.pieces.index(piece)] for piece, _, _ in stream.keep]
    keep_index = torch.stack(keep) if keep else torch.zeros(0, ctx, dtype=torch.long)
    return _ConvPlan(ForkPlan(base.num_tokens, tuple(levels), base.gather_back), external, keep_index.to(device))


class _StreamStates(ForkStates):
    """Depth-0 segments with a parent in an earlier chunk start from its kept state; kept pieces' finals recorded."""

    def __init__(self, fork: StreamFork, record: bool):
        super().__init__()
        self.fork, self.record, self.level = fork, record, None

    def _segments(self, level: Level) -> list[int]:
        return self.fork.layout.seg_id[level.token_index[:, 0].cpu()].tolist()

    def initial(self, level: Level):
        self.level = level
        out = super().initial(level)
        if level.depth != 0:
            return out
        st = self.fork.stream
        parents = [st.external[s] if self.fork.layout.parents[s] < 0 else -1 for s in self._segments(level)]
        if all(p < 0 for p in parents):
            return out
        kept = [st.store.kept[(p, self.fork.m, "state")] if p >= 0 else None for p in parents]
        like = next(t for t in kept if t is not None)
        return torch.stack([t if t is not None else torch.zeros_like(like) for t in kept])

    def add(self, final: torch.Tensor) -> None:
        super().add(final)
        st = self.fork.stream
        wanted = {st.pieces.index(piece): piece for piece, _, _ in st.keep}
        for r, s in enumerate(self._segments(self.level)):
            if s in wanted:
                kept = final[r]  # taken on every call (a recomputation saves what the forward saved)
                if self.record:
                    st.store.keep(st.chunk, (wanted[s], self.fork.m, "state"), kept, st.train)

