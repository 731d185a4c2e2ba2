"""State forking for stateful token mixers over a packed row (pure PyTorch, the kernels layer).

A hybrid decoder's stateful mixer (Gated DeltaNet, Mamba2) is a causal depthwise convolution
(kernel ``k``) followed by a chunked recurrent scan. In a packed row ``[P; R1; ...; RG]`` a mask
cannot keep ``R2`` from starting where ``R1`` ended, so the state is forked at the segment
boundaries of the :class:`~flexgroup.layout.Layout`:

- **conv**: a segment's convolution sees the last ``k - 1`` conv inputs of its parent *path*
  (gathered across as many ancestor segments as needed; zeros where the path is shorter);
- **recurrent scan**: a root segment starts from zeros; every other segment starts from the final
  recurrent state of its parent segment. Segments at the same tree depth run in one call,
  right-padded, with per-sequence initial states; padded steps have zero decay and zero input, so a
  padded row's final state is its last real token's state.

:func:`fork_plan` builds the index tensors (a :class:`ForkPlan`, once per forward: the carrier
keeps it with the other per-forward plans); :func:`forked_conv`, :func:`forked_gated_delta` and
:func:`forked_mamba2_scan` run a stock kernel (``original``) per level and reassemble the packed
row. The transformers glue that calls them is :mod:`flexgroup.patches.hybrid`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..layout import Layout

__all__ = ["ForkPlan", "Level", "fork_plan", "conv_context", "FILL", "padded", "pack_back", "ForkStates", "forked_conv",
           "forked_gated_delta", "forked_mamba2_scan"]


@dataclass(frozen=True, eq=False)
class Level:
    """One call: ``n`` segments of one tree depth, right-padded to ``m`` tokens.

    depth: the tree depth of its segments (levels come in depth order).
    conv_index: LongTensor [n, k-1+m] -- packed-row token of each conv input (``L`` = a zero row):
        the last ``k-1`` tokens of the segment's ancestor path, then its own tokens.
    token_index: LongTensor [n, m] -- packed-row token of each scan step (``L`` for padding).
    parent_rows: LongTensor [n] -- each segment's parent among the final states of the previous depth
        (its levels' rows concatenated in order); None at depth 0.
    """

    depth: int
    conv_index: torch.Tensor
    token_index: torch.Tensor
    parent_rows: torch.Tensor | None

    def to(self, device) -> "Level":
        p = None if self.parent_rows is None else self.parent_rows.to(device)
        return Level(self.depth, self.conv_index.to(device), self.token_index.to(device), p)


@dataclass(frozen=True, eq=False)
class ForkPlan:
    """Index tensors that split a packed row into per-depth padded batches and back.

    levels: :class:`Level` calls in depth order (one per depth, or more where one padded call would be
        less than ``FILL`` real tokens).
    gather_back: LongTensor [L] -- for each packed token, its row in the concatenation of the levels'
        flattened ``[n * m]`` outputs.
    """

    num_tokens: int
    levels: tuple
    gather_back: torch.Tensor

    def to(self, device) -> "ForkPlan":
        """This plan with its index tensors on ``device`` (itself when they are there already)."""
        device = torch.device(device)
        if device == self.gather_back.device:
            return self
        return ForkPlan(self.num_tokens, tuple(lv.to(device) for lv in self.levels), self.gather_back.to(device))


FILL = 0.75  # a depth's segments are split into several calls where one padded call would be less real tokens


def _calls(segs: list[int], lengths: tuple) -> list[list[int]]:
    """``segs`` (longest first) cut into runs whose padded call is at least ``FILL`` real tokens."""
    out: list[list[int]] = []
    for s in segs:
        if out and sum(lengths[t] for t in out[-1]) + lengths[s] >= FILL * (len(out[-1]) + 1) * lengths[out[-1][0]]:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def conv_context(layout: Layout, s: int, ctx: int) -> list[int]:
    """The last ``ctx`` tokens before segment ``s`` on its path (fewer near a root)."""
    before: list[int] = []
    for a in reversed(layout.ancestors[s]):  # nearest ancestor first
        if len(before) >= ctx:
            break
        before = list(layout.segment_range(a))[-(ctx - len(before)):] + before
    return before[-ctx:] if ctx else []


def fork_plan(layout: Layout, conv_kernel: int) -> ForkPlan:
    """The :class:`ForkPlan` of ``layout`` for a causal conv of width ``conv_kernel`` (CPU tensors).

    Built once per forward per conv width and device, and kept in the carrier with the other
    per-forward plans (:meth:`flexgroup.data.carrier.GroupedMask.plan`); no process-wide cache.
    """
    L, ctx = layout.num_tokens, conv_kernel - 1
    depth = [len(a) for a in layout.ancestors]
    by_depth: list[list[int]] = [[] for _ in range(max(depth) + 1)]
    for s in sorted(range(layout.num_segments), key=lambda s: (-layout.lengths[s], s)):
        by_depth[depth[s]].append(s)
    row = {s: r for segs in by_depth for r, s in enumerate(segs)}  # row among the final states of its depth
    calls = [(d, segs) for d, segs_d in enumerate(by_depth) for segs in _calls(segs_d, layout.lengths)]
    levels, back, base = [], [0] * L, 0
    for d, segs in calls:
        m = layout.lengths[segs[0]]
        conv_index = torch.full((len(segs), ctx + m), L, dtype=torch.long)
        token_index = torch.full((len(segs), m), L, dtype=torch.long)
        for r, s in enumerate(segs):
            own = list(layout.segment_range(s))
            before = conv_context(layout, s, ctx)
            conv_index[r, ctx - len(before): ctx] = torch.tensor(before, dtype=torch.long)
            conv_index[r, ctx: ctx + len(own)] = torch.tensor(own, dtype=torch.long)
            token_index[r, : len(own)] = torch.tensor(own, dtype=torch.long)
            for j, t in enumerate(own):
                back[t] = base + r * m + j
        parents = None if d == 0 else torch.tensor([row[layout.parents[s]] for s in segs], dtype=torch.long)
        levels.append(Level(d, conv_index, token_index, parents))
        base += len(segs) * m
    return ForkPlan(L, tuple(levels), torch.tensor(back, dtype=torch.long))


def padded(x: torch.Tensor) -> torch.Tensor:
    """``x`` [1, L, ...] -> [L + 1, ...] with a zero row at index ``L`` (what padding gathers)."""
    return torch.cat([x[0], x.new_zeros((1,) + x.shape[2:])], 0)


class ForkStates:
    """Final recurrent states of the calls so far, handed to the next depth as initial states."""

    def __init__(self):
        self.depth, self.previous, self.current = 0, None, []

    def initial(self, level: Level) -> torch.Tensor | None:
        """[n, ...] initial states of ``level``'s rows (None at depth 0: zeros)."""
        if level.depth != self.depth:
            self.depth, self.previous, self.current = level.depth, torch.cat(self.current, 0), []
        return None if level.parent_rows is None else self.previous[level.parent_rows]

    def add(self, final: torch.Tensor) -> None:
        self.current.append(final)


def pack_back(parts: list[torch.Tensor], plan: ForkPlan) -> torch.Tensor:
    """Per-level outputs [n, m, ...] -> the packed row [1, L, ...]."""
    flat = torch.cat([p.reshape((-1,) + p.shape[2:]) for p in parts], 0)
    return flat[plan.gather_back][None]


# ------------------------------------------------------------------------- the forked computations
def forked_conv(original: Callable, plan: ForkPlan, hidden_states: torch.Tensor, weight: torch.Tensor,
                bias=None, activation=None, conv_input: Callable | None = None, **kwargs) -> torch.Tensor:
    """``hidden_states`` [1, C, L] -> [1, C, L]: ``original`` (a causal conv) per level, each segment
    after its path's last ``k - 1`` inputs. ``conv_input(x, plan)`` may extend the gathered rows
    ``x`` [L + 1, C] (a streamed chunk appends the conv inputs kept from earlier forwards)."""
    x = padded(hidden_states.transpose(1, 2))  # [L+1, C]
    if conv_input is not None:
        x = conv_input(x, plan)
    ctx = weight.shape[-1] - 1
    parts = []
    for lv in plan.levels:
        xs = x[lv.conv_index].transpose(1, 2)  # [n, C, k-1+m]
        out = original(xs, weight, bias, activation=activation, **kwargs)  # stock: causal, zero left pad
        parts.append(out[:, :, ctx:].transpose(1, 2))  # [n, m, C]
    return pack_back(parts, plan).transpose(1, 2)


def forked_gated_delta(original: Callable, plan: ForkPlan, query, key, value, g, beta,
                       states: ForkStates | None = None, **kwargs) -> torch.Tensor:
    """q/k [1, L, Hk, K], v [1, L, Hv, V], g/beta [1, L, Hv] -> [1, L, Hv, V]: ``original`` (the chunked
    gated delta rule) per level, each segment from its parent's final state (``states``: where they are
    kept between depths; a streamed chunk's also starts roots from kept states)."""
    outs, states = [], states if states is not None else ForkStates()
    rows = [padded(t) for t in (query, key, value, g, beta)]
    for lv in plan.levels:
        q, k, v, gl, bl = (t[lv.token_index] for t in rows)  # [n, m, ...], padding: zeros
        out, final = original(q, k, v, g=gl, beta=bl, initial_state=states.initial(lv), output_final_state=True,
                              **kwargs)
        states.add(final)
        outs.append(out)
    return pack_back(outs, plan)


def forked_mamba2_scan(original: Callable, plan: ForkPlan, hidden_states, dt, A, B, C, chunk_size, D=None,
                       dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")), states: ForkStates | None = None,
                       **kwargs) -> torch.Tensor:
    """x [1, L, H, P], dt [1, L, H], B/C [1, L, G, N] -> y [1, L, H, P]: ``original`` (the Mamba2 chunk
    scan) per level, each segment from its parent's final state."""
    # the scan's own dt preprocessing, done first so that padded steps can get dt = 0 (no decay, no input)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    outs, states = [], states if states is not None else ForkStates()
    rows = [padded(t) for t in (hidden_states, dt, B, C)]
    for lv in plan.levels:
        x, d, b, c = (t[lv.token_index] for t in rows)  # [n, m, ...], padding: zeros
        # dt is final (clamped above): a lower limit here would lift the padded steps' dt = 0
        out, final = original(x, d, A, b, c, chunk_size, D=D, dt_bias=None, initial_states=states.initial(lv),
                              dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=True, **kwargs)
        states.add(final)
        outs.append(out)
    return pack_back(outs, plan)
