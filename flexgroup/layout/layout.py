"""Layout: an immutable value describing who attends to whom in one packed row (the core layer).

A packed row is a forest of *segments*. Segment ``i`` holds ``lengths[i]`` consecutive tokens and
has a parent ``parents[i] < i`` (or ``-1`` for a root). Segments are laid out in index order, so
every ancestor of a segment lies physically before it. A token attends

- causally to the earlier tokens of its own segment, and
- to every token of every ancestor segment,

which is exactly the context it has in its own root-to-leaf sequence run alone. Its *virtual
position* is its index in that sequence. A one-prompt GRPO group is the two-level tree
``parents=[-1, 0, 0, ...]``.

The per-token metadata used by masks is kept as tensors whose size follows the number of tokens
(``seg_id``, ``position_ids``, ``tin``/``tout``): ``tin``/``tout`` are the Euler-tour interval of the
token's segment, so "segment a is an ancestor-or-self of segment b" is
``tin[a] <= tin[b] < tout[a]`` -- one comparison pair, no segment-by-segment table.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Callable, Sequence

import torch

from .checks import check_int, normal_tensors

__all__ = ["Layout", "Cost"]


@dataclass(frozen=True)
class Cost:
    """Exact work of a layout versus the repeated-prefix baseline, per layer.

    ``*_tokens`` count tokens through every projection and MLP; ``*_pairs`` count causal
    (query, key) pairs that attention computes. The baseline runs every sequence of the batch on
    its own (a strict prefix or a duplicate of another sequence counts in full).
    """

    baseline_tokens: int
    grouped_tokens: int
    baseline_pairs: int
    grouped_pairs: int

    @property
    def token_ratio(self) -> float:
        """baseline / grouped tokens (> 1 means grouping saves work)."""
        return self.baseline_tokens / self.grouped_tokens

    @property
    def pair_ratio(self) -> float:
        """baseline / grouped attention pairs."""
        return self.baseline_pairs / self.grouped_pairs

    def ideal_speedup(self, flops_per_token: float, flops_per_pair: float) -> float:
        """Ideal speedup when a token costs ``flops_per_token`` and a causal pair ``flops_per_pair``.

        For a decoder layer with hidden ``d``, ``Hq``/``Hkv`` heads of size ``Dh`` and MLP width
        ``f``: ``flops_per_token = 2*d*(Hq*Dh + 2*Hkv*Dh) + 2*Hq*Dh*d + 6*d*f`` (gated MLP) and
        ``flops_per_pair = 4*Hq*Dh`` (QK^T and PV).
        """
        base = self.baseline_tokens * flops_per_token + self.baseline_pairs * flops_per_pair
        grp = self.grouped_tokens * flops_per_token + self.grouped_pairs * flops_per_pair
        return base / grp

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(*(a + b for a, b in zip(self._astuple(), other._astuple())))

    def _astuple(self) -> tuple[int, int, int, int]:
        return (self.baseline_tokens, self.grouped_tokens, self.baseline_pairs, self.grouped_pairs)


def _as_list(name: str, value) -> list:
    """``value`` as a list (tensors via ``tolist``), or ValueError naming it."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list, got {value!r} ({type(value).__name__})")
    return list(value)


class Layout:
    """Immutable description of one packed row (a forest of segments).

    Build it with :meth:`group`, :meth:`tree` or :meth:`pack`; do not call the constructor.

    Attributes:
        parents: tuple[int, ...], parent segment of each segment (-1 for a root), global indices.
        lengths: tuple[int, ...], tokens per segment (all >= 1).
        num_tokens: total tokens ``L``.
    """

    def __init__(self, parents: Sequence[int], lengths: Sequence[int], *, _validated: bool = False):
        if not _validated:
            parents, lengths = self._validate(parents, lengths)
        object.__setattr__(self, "parents", tuple(parents))
        object.__setattr__(self, "lengths", tuple(lengths))

    def __setattr__(self, name, value):  # cached_property writes to __dict__ directly
        raise AttributeError(f"Layout is immutable (tried to set {name!r})")

    def __delattr__(self, name):
        raise AttributeError(f"Layout is immutable (tried to delete {name!r})")

    # ------------------------------------------------------------------ constructors
    @staticmethod
    def _validate(parents, lengths) -> tuple[list[int], list[int]]:
        parents = _as_list("parents", parents)
        lengths = _as_list("lengths", lengths)
        if len(parents) != len(lengths):
            raise ValueError(
                f"parents has {len(parents)} entries but lengths has {len(lengths)}: "
                "give one parent and one length per segment"
            )
        if not lengths:
            raise ValueError("a layout needs at least one segment (got no segments)")
        lengths = [check_int(f"lengths[{i}]", n, 1) for i, n in enumerate(lengths)]
        out = []
        for i, p in enumerate(parents):
            p = check_int(f"parents[{i}]", p, -1)
            if p >= i:
                raise ValueError(
                    f"parents[{i}] = {p}: a parent must be an earlier segment (< {i}) or -1 for a root"
                )
            out.append(p)
        return out, lengths

    @classmethod
    def tree(cls, parents: Sequence[int], lengths: Sequence[int]) -> "Layout":
        """A forest of segments laid out in the given order.

        Args:
            parents: segment ``i``'s parent, an earlier segment index, or -1 for a root.
            lengths: tokens in segment ``i``, each >= 1.
        """
        return cls(parents, lengths)

    @classmethod
    def group(cls, prefix_len: int, response_lens: Sequence[int]) -> "Layout":
        """One prompt of ``prefix_len`` tokens followed by G responses ``[P; R1; ...; RG]``."""
        prefix_len = check_int("prefix_len", prefix_len, 1)
        response_lens = _as_list("response_lens", response_lens)
        if not response_lens:
            raise ValueError("response_lens is empty: a group needs at least one response")
        lens = [check_int(f"response_lens[{i}]", n, 1) for i, n in enumerate(response_lens)]
        return cls([-1] + [0] * len(lens), [prefix_len] + lens)

    @classmethod
    def pack(cls, layouts: Sequence["Layout"]) -> "Layout":
        """Independent layouts side by side in one row; they never attend to each other."""
        if isinstance(layouts, Layout):
            raise ValueError("Layout.pack takes a list of layouts, got a single Layout: use Layout.pack([layout])")
        layouts = _as_list("layouts", layouts)
        if not layouts:
            raise ValueError("Layout.pack got an empty list: give at least one layout")
        parents, lengths = [], []
        for j, lay in enumerate(layouts):
            if not isinstance(lay, Layout):
                raise ValueError(f"Layout.pack: item {j} is {type(lay).__name__}, not a Layout")
            off = len(parents)
            parents += [p + off if p >= 0 else -1 for p in lay.parents]
            lengths += list(lay.lengths)
        return cls(parents, lengths, _validated=True)

    def padded(self, multiple: int) -> "Layout":
        """This layout plus one padding root segment up to a multiple of ``multiple`` tokens (itself when its
        length divides). Padding tokens form their own tree: real tokens never attend to them, and each
        padding row attends to earlier padding tokens only, so it is never empty. Cached per (layout, multiple)."""
        return _padded(self, check_int("multiple", multiple, 1))

    # ------------------------------------------------------------------ python-side structure
    @property
    def num_segments(self) -> int:
        return len(self.lengths)

    @cached_property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """Physical start of each segment."""
        out, s = [], 0
        for n in self.lengths:
            out.append(s)
            s += n
        return tuple(out)

    @cached_property
    def ancestors(self) -> tuple[tuple[int, ...], ...]:
        """Ancestors of each segment, root first, excluding the segment itself."""
        anc: list[tuple[int, ...]] = []
        for p in self.parents:
            anc.append(() if p < 0 else anc[p] + (p,))
        return tuple(anc)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Virtual position of each segment's first token (total length of its ancestors)."""
        off: list[int] = []
        for p in self.parents:
            off.append(0 if p < 0 else off[p] + self.lengths[p])
        return tuple(off)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        ch: list[list[int]] = [[] for _ in self.lengths]
        for i, p in enumerate(self.parents):
            if p >= 0:
                ch[p].append(i)
        return tuple(tuple(c) for c in ch)

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        """Leaf segments in order of appearance."""
        return tuple(i for i, c in enumerate(self.children) if not c)

    @cached_property
    def roots(self) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.parents) if p < 0)

    @cached_property
    def component(self) -> tuple[int, ...]:
        """Root segment index of each segment (its tree in the forest)."""
        comp: list[int] = []
        for i, p in enumerate(self.parents):
            comp.append(i if p < 0 else comp[p])
        return tuple(comp)

    @cached_property
    def max_position(self) -> int:
        """Largest virtual position in the row (``max(position_ids)``)."""
        return max(o + n for o, n in zip(self.offsets, self.lengths)) - 1

    @cached_property
    def euler_intervals(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(tin, tout)``, one entry per segment: the Euler-tour interval of each segment (read-only).

        Pre-order numbering over the forest: segment ``a`` is an ancestor-or-self of ``b`` iff
        ``tin[a] <= tin[b] < tout[a]`` (what the masks layer's block builder and mask_mod test).
        """
        n = self.num_segments
        tin, tout = [0] * n, [0] * n
        clock = 0
        for r in self.roots:
            stack = [(r, False)]
            while stack:
                s, done = stack.pop()
                if done:
                    tout[s] = clock
                    continue
                tin[s] = clock
                clock += 1
                stack.append((s, True))
                stack.extend((c, False) for c in reversed(self.children[s]))
        return tuple(tin), tuple(tout)

    # ------------------------------------------------------------------ token-level tensors (CPU)
    # The cached tensors are private; the public properties return copies, so that a caller editing
    # what it got (``pos += 1``) cannot corrupt the layout's masks. They are built outside inference mode
    # (checks.normal_tensors): a layout first used under torch.inference_mode() still serves training.
    @cached_property
    @normal_tensors
    def _seg_id(self) -> torch.Tensor:
        return self._per_token(torch.arange(self.num_segments))

    @cached_property
    @normal_tensors
    def _position_ids(self) -> torch.Tensor:
        # a token's position is its index less (start - offset) of its segment: one [L] temporary
        shift = torch.tensor([s - o for s, o in zip(self.starts, self.offsets)], dtype=torch.long)
        return torch.arange(self.num_tokens).sub_(self._per_token(shift))

    def _per_token(self, per_segment: torch.Tensor) -> torch.Tensor:
        """LongTensor [num_tokens]: ``per_segment`` [num_segments] repeated over each segment's tokens."""
        return torch.repeat_interleave(per_segment, torch.tensor(self.lengths, dtype=torch.long),
                                       output_size=self.num_tokens)

    @property
    def seg_id(self) -> torch.Tensor:
        """LongTensor [num_tokens]: segment of each token (a fresh copy)."""
        return self._seg_id.clone()

    @property
    def position_ids(self) -> torch.Tensor:
        """LongTensor [num_tokens]: virtual position of each token (index in its root-to-leaf
        sequence); a fresh copy on every access."""
        return self._position_ids.clone()

    @cached_property
    @normal_tensors
    def _euler_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        tin, tout = self.euler_intervals
        return self._per_token(torch.tensor(tin, dtype=torch.long)), self._per_token(torch.tensor(tout, dtype=torch.long))

    def token_tensors(self) -> dict[str, torch.Tensor]:
        """Per-token metadata on CPU, fresh copies: ``seg``, ``pos`` (virtual), ``tin``, ``tout`` -- each [L].

        ``tin``/``tout`` are the Euler-tour interval of the token's segment (see the module docstring).
        The masks and kernels layers move these to a device once per forward.
        """
        tin, tout = self._euler_tokens
        return {"seg": self._seg_id.clone(), "pos": self._position_ids.clone(), "tin": tin.clone(),
                "tout": tout.clone()}

    def segment_range(self, s: int) -> range:
        return range(self.starts[s], self.starts[s] + self.lengths[s])

    def paths(self) -> list[torch.Tensor]:
        """Token indices (LongTensor [n_i]) of each root-to-leaf sequence, leaves in order of appearance."""
        out = []
        for leaf in self.leaves:
            segs = self.ancestors[leaf] + (leaf,)
            out.append(torch.cat([torch.arange(self.starts[s], self.starts[s] + self.lengths[s]) for s in segs]))
        return out

    # ------------------------------------------------------------------ sequences
    # A batch's sequences need not end at leaves: a sequence that is a strict prefix of another (or a
    # duplicate) ends inside a segment. A sequence is named by the packed index of its last token (its
    # *end*); it is the root-to-end path. Per-sequence facts (lengths, counts, cost) take these ends;
    # without them the sequences are the root-to-leaf paths of :meth:`paths`.
    @cached_property
    def leaf_ends(self) -> tuple[int, ...]:
        """Packed index of the last token of each leaf segment: the ends of :meth:`paths`."""
        return tuple(self.starts[leaf] + self.lengths[leaf] - 1 for leaf in self.leaves)

    def _ends(self, ends: Sequence[int] | torch.Tensor | None) -> tuple[int, ...]:
        if ends is None:
            return self.leaf_ends
        ends = _as_list("ends", ends)
        if not ends:
            raise ValueError("ends is empty: give the packed index of each sequence's last token")
        return tuple(check_int(f"ends[{i}]", e, 0) for i, e in enumerate(ends))

    def _seg_of(self, e: int) -> int:
        if e >= self.num_tokens:
            raise ValueError(f"sequence end {e} is outside the row of {self.num_tokens} tokens")
        return int(self._seg_id[e])

    def sequence_lengths(self, ends: Sequence[int] | torch.Tensor | None = None) -> list[int]:
        """Tokens of each sequence: ``position of its end + 1``.

        Args:
            ends: packed index of each sequence's last token (a sequence is the root-to-end path; it
                may end inside a segment). Default: :attr:`leaf_ends`, the sequences of :meth:`paths`.
        """
        out = []
        for e in self._ends(ends):
            s = self._seg_of(e)
            out.append(self.offsets[s] + e - self.starts[s] + 1)
        return out

    def sequence_counts(self, ends: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """LongTensor [num_tokens]: how many sequences (``ends``, see :meth:`sequence_lengths`) contain each token."""
        diff = [0] * (self.num_tokens + 1)
        for e in self._ends(ends):
            s = self._seg_of(e)
            diff[self.starts[s]] += 1  # the end's own segment up to the end
            diff[e + 1] -= 1
            for a in self.ancestors[s]:  # every ancestor segment whole
                diff[self.starts[a]] += 1
                diff[self.starts[a] + self.lengths[a]] -= 1
        return torch.tensor(diff[:-1], dtype=torch.long).cumsum(0)

    def cost(self, ends: Sequence[int] | torch.Tensor | None = None) -> Cost:
        """Tokens and causal attention pairs: repeated-prefix baseline versus this packed layout.

        The baseline runs each sequence alone: ``ends`` as in :meth:`sequence_lengths` (default the
        root-to-leaf paths). A batch knows its sequences: prefer ``GroupedBatch.cost()``.
        """
        lens = self.sequence_lengths(ends)
        b_tokens = sum(lens)
        b_pairs = sum(n * (n + 1) // 2 for n in lens)
        g_pairs = sum(n * o + n * (n + 1) // 2 for n, o in zip(self.lengths, self.offsets))
        return Cost(b_tokens, self.num_tokens, b_pairs, g_pairs)

    # ------------------------------------------------------------------ the oracle
    def dense_mask(self, pattern: Callable | None = None) -> torch.Tensor:
        """BoolTensor [L, L], ``[q, kv]`` True where q may attend kv. Brute force: the test oracle.

        Computed from paths (each token's context is its root-to-leaf prefix), not from any mask_mod;
        ``pattern(q_pos, kv_pos)`` on virtual positions restricts it further. The FlexAttention objects
        (``mask_mod``, ``block_mask``, ``draw``) are :mod:`flexgroup.layout.masks` functions.
        """
        L = self.num_tokens
        m = torch.zeros(L, L, dtype=torch.bool)
        for s in range(self.num_segments):
            ctx = [t for a in self.ancestors[s] for t in self.segment_range(a)]
            for q in self.segment_range(s):
                m[q, ctx + list(range(self.starts[s], q + 1))] = True
        if pattern is not None:
            pos = self.position_ids
            m &= pattern(pos[:, None], pos[None, :]).expand(L, L)
        return m

    # ------------------------------------------------------------------ misc
    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and self.parents == other.parents and self.lengths == other.lengths

    def __hash__(self) -> int:
        return hash((self.parents, self.lengths))

    def __repr__(self) -> str:
        if self.num_segments <= 12:
            return f"Layout(parents={list(self.parents)}, lengths={list(self.lengths)})"
        return f"Layout({self.num_segments} segments, {len(self.roots)} trees, {self.num_tokens} tokens)"


@lru_cache(maxsize=32)
def _padded(layout: Layout, multiple: int) -> Layout:
    pad = -layout.num_tokens % multiple
    return layout if pad == 0 else Layout.pack([layout, Layout.tree([-1], [pad])])
