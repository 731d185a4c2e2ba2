"""Independent oracles and hypothesis strategies for the core tests (layout, patterns, masks, attention).

Nothing here uses flexgroup's mask, path or position code: root-to-leaf sequences are rebuilt from
``parents``/``lengths`` by walking parent pointers, and every sequence is attended on its own with
plain causal attention (explicit softmax, GQA through ``repeat_interleave``), patterns and
score_mods evaluated on ``arange`` positions.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import pytest
import torch
from hypothesis import strategies as st

from flexgroup import Layout, patterns as P


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Run a module's tests on one intra-op thread, restoring the setting afterwards.

    These tests run many small ops; on a shared, loaded 2-core machine two OpenMP threads made them
    up to 50x slower (threads spinning at barriers). Import this fixture into a test module to use it.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------- structure oracles


def ref_paths(parents: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    """Token indices of every root-to-leaf sequence, leaves in order of appearance (parent walk)."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    has_child = {p for p in parents if p >= 0}
    out = []
    for leaf in range(len(lengths)):
        if leaf in has_child:
            continue
        chain, s = [], leaf
        while s >= 0:
            chain.append(s)
            s = parents[s]
        out.append([t for s in reversed(chain) for t in range(starts[s], starts[s] + lengths[s])])
    return out


def ref_dense_mask(parents, lengths, pattern: Callable | None = None) -> torch.Tensor:
    """[L, L] bool: q may attend kv iff kv precedes-or-is q in some path containing q (and the pattern
    allows their positions in that path)."""
    L = sum(lengths)
    m = torch.zeros(L, L, dtype=torch.bool)
    for path in ref_paths(parents, lengths):
        n = len(path)
        ar = torch.arange(n)
        allowed = ar[None, :] <= ar[:, None]
        if pattern is not None:
            allowed = allowed & pattern(ar[:, None], ar[None, :])
        idx = torch.tensor(path)
        m[idx[:, None], idx[None, :]] |= allowed
    return m


def ref_position_ids(parents, lengths) -> torch.Tensor:
    pos = torch.full((sum(lengths),), -1, dtype=torch.long)
    for path in ref_paths(parents, lengths):
        pos[torch.tensor(path)] = torch.arange(len(path))
    return pos


# ---------------------------------------------------------------------------------- attention oracle


def causal_attention(q, k, v, *, pattern=None, score_mod=None, scale=None) -> torch.Tensor:
    """One sequence alone: q [1, Hq, n, D], k/v [1, Hkv, n, D] -> [1, Hq, n, D], computed in float64.

    Explicit softmax; positions are ``arange(n)``; rows with no allowed key return 0.
    """
    _, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    dt = q.dtype
    q, k, v = q.double(), k.double().repeat_interleave(g, dim=1), v.double().repeat_interleave(g, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale  # [1, Hq, n, n]
    pos = torch.arange(n)
    if score_mod is not None:
        b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        h = torch.arange(hq).view(1, hq, 1, 1)
        s = score_mod(s, b, h, pos.view(1, 1, n, 1), pos.view(1, 1, 1, n))
    allowed = pos[None, :] <= pos[:, None]
    if pattern is not None:
        allowed = allowed & pattern(pos[:, None], pos[None, :])
    s = s.masked_fill(~allowed, float("-inf"))
    row_ok = allowed.any(-1)
    s = torch.where(row_ok[:, None], s, torch.zeros_like(s))  # avoid NaN; zeroed below
    p = torch.softmax(s, dim=-1) * row_ok[:, None]
    return (p @ v).to(dt)


def reference_attention(q, k, v, lay: Layout, *, pattern=None, score_mod=None, scale=None) -> torch.Tensor:
    """Run every root-to-leaf sequence alone and scatter the outputs back to physical tokens.

    A shared token appears in several sequences with the same context; the first sequence that
    holds it provides its output (so gradients flow exactly once per physical token).
    """
    L = q.shape[2]
    out = q.new_zeros(q.shape)
    done = torch.zeros(L, dtype=torch.bool)
    for path in ref_paths(lay.parents, lay.lengths):
        idx = torch.tensor(path)
        o = causal_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx],
                             pattern=pattern, score_mod=score_mod, scale=scale)
        new = ~done[idx]
        out[:, :, idx[new]] = o[:, :, new]
        done[idx] = True
    assert bool(done.all())
    return out


# ---------------------------------------------------------------------------------- strategies


@st.composite
def forests(draw, max_segments: int = 8, max_len: int = 64, max_depth: int = 4, max_branch: int = 4,
            max_tokens: int | None = None):
    """(parents, lengths) of a random forest: depth <= max_depth segments, <= max_branch children.

    A new segment picks its parent among *all* earlier segments (or starts a new root), so later
    roots' segments interleave with earlier trees' segments.
    """
    n = draw(st.integers(1, max_segments))
    parents, depth, nchild = [], [], []
    for i in range(n):
        ok = [j for j in range(i) if depth[j] < max_depth and nchild[j] < max_branch]
        p = draw(st.sampled_from([-1] + ok)) if ok else -1
        parents.append(p)
        depth.append(1 if p < 0 else depth[p] + 1)
        nchild.append(0)
        if p >= 0:
            nchild[p] += 1
    lengths = draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n))
    if max_tokens is not None:
        while sum(lengths) > max_tokens:  # shrink the longest segment until the row fits
            i = max(range(n), key=lambda j: lengths[j])
            lengths[i] = max(1, lengths[i] // 2)
    return parents, lengths


@st.composite
def layouts(draw, max_segments: int = 8, max_len: int = 64, max_tokens: int | None = None):
    """A Layout built by group, tree or pack (packs of several groups/trees)."""
    kind = draw(st.sampled_from(["group", "tree", "pack"]))
    if kind == "group":
        g = draw(st.integers(1, max(1, max_segments - 1)))
        lens = draw(st.lists(st.integers(1, max_len), min_size=g + 1, max_size=g + 1))
        if max_tokens is not None:
            while sum(lens) > max_tokens:
                i = max(range(len(lens)), key=lambda j: lens[j])
                lens[i] = max(1, lens[i] // 2)
        return Layout.group(lens[0], lens[1:])
    if kind == "tree":
        return Layout.tree(*draw(forests(max_segments, max_len, max_tokens=max_tokens)))
    parts = draw(st.integers(2, 4))
    per = max(1, max_segments // parts)
    budget = None if max_tokens is None else max(per, max_tokens // parts)
    return Layout.pack([Layout.tree(*draw(forests(per, max_len, max_tokens=budget))) for _ in range(parts)])


def user_pattern(q_pos, kv_pos):
    """A user callable with no block bounds: keys at even distance or within 2 positions."""
    return ((q_pos - kv_pos) % 2 == 0) | (q_pos - kv_pos < 2)


def user_score_mod(score, b, h, q_pos, kv_pos):
    """A user score_mod on virtual positions: a head-dependent distance bias plus a position bump."""
    return score - 0.05 * (h + 1) * (q_pos - kv_pos) + 0.1 * (kv_pos % 3 == 0)


BLOCK_ALLOWED = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1], [1, 0, 1]], dtype=torch.bool)

# name -> (pattern, exact block bounds?)
PATTERNS: dict[str, tuple[Callable | None, bool]] = {
    "none": (None, True),
    "sliding_window_1": (P.sliding_window(1), True),
    "sliding_window_5": (P.sliding_window(5), True),
    "chunked_4": (P.chunked(4), True),
    "chunked_7": (P.chunked(7), True),
    "sinks_2_3": (P.sinks(2, 3), True),
    "strided_3": (P.strided(3), True),
    "strided_4_local_2": (P.strided(4, local=2), True),
    "block_sparse_3": (P.block_sparse(3, BLOCK_ALLOWED), True),
    "block_sparse_1": (P.block_sparse(1, torch.rand(9, 11, generator=torch.Generator().manual_seed(0)) > 0.4), True),
    "user_callable": (user_pattern, False),
    "window_or_chunk": (P.sliding_window(3) | P.chunked(8), True),
    "window_and_strided": (P.sliding_window(9) & P.strided(2), False),
    "prefix_tokens_0": (P.prefix_tokens(0), True),  # allows nothing: every row empty
}


def slopes(h: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-(i + 1)) for i in range(h)])
