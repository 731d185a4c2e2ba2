"""The masks layer: who-attends-to-whom of a :class:`~flexgroup.layout.Layout` as FlexAttention objects.

- :func:`mask_mod`: the exact FlexAttention mask_mod on physical indices (tree-causal rule, and a
  pattern on virtual positions);
- :func:`block_mask`: the analytic BlockMask (see :mod:`flexgroup.blockmask`), cached here;
- :func:`dense_mask`: a brute-force ``[L, L]`` oracle computed from paths, for tests;
- :func:`draw`: a text drawing of the block mask.

This layer owns its caches (a bounded LRU of block masks keyed by layout value, pattern, device and
block size). A block mask may be cached for any pattern, user callables included: for a callable
pattern the block tables are conservative (never "full", "empty" only by tree structure), and its
mask_mod evaluates the callable at kernel time, so a closure whose captured value changes is read
anew. Kernels that precompute more than that (the sdpa plan) re-plan once per forward instead.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from .blockmask import build_block_mask, check_block_size, draw_block_mask
from .layout import Layout

__all__ = ["mask_mod", "block_mask", "dense_mask", "draw", "token_tensors", "pattern_key"]

_BLOCK_MASKS: "OrderedDict[tuple, object]" = OrderedDict()
BLOCK_MASK_CACHE_SIZE = 32


def token_tensors(layout: Layout, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Per-token metadata of ``layout`` on ``device`` (fresh tensors): ``seg``, ``pos``, ``tin``, ``tout`` [L]."""
    return {k: v.to(device) for k, v in layout.token_tensors().items()}


def pattern_key(pattern) -> object:
    """A dict key for ``pattern``: the pattern itself when hashable, else its identity."""
    try:
        hash(pattern)
        return pattern
    except TypeError:  # an unhashable user callable: key on identity (the cached mask keeps it alive)
        return ("id", id(pattern))


def mask_mod(layout: Layout, pattern: Callable | None = None, device: torch.device | str = "cpu",
             tokens: dict[str, torch.Tensor] | None = None) -> Callable:
    """FlexAttention mask_mod ``(b, h, q_idx, kv_idx) -> BoolTensor`` on physical indices.

    ``q_idx`` may attend ``kv_idx`` when ``kv_idx <= q_idx`` and the key's segment is an
    ancestor-or-self of the query's (Euler-tour interval test), and ``pattern(q_pos, kv_pos)`` -- on
    virtual positions -- allows it. ``tokens`` (from :func:`token_tensors`) avoids a second copy.
    """
    t = token_tensors(layout, device) if tokens is None else tokens
    pos, tin, tout = t["pos"], t["tin"], t["tout"]

    def tree_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (tin[kv_idx] <= tin[q_idx]) & (tin[q_idx] < tout[kv_idx])

    if pattern is None:
        return tree_causal
    # a kernel must not read host tensors: built-in patterns move their tables to ``device``
    pattern = pattern.to_device(device) if hasattr(pattern, "to_device") else pattern

    def tree_causal_pattern(b, h, q_idx, kv_idx):
        return tree_causal(b, h, q_idx, kv_idx) & pattern(pos[q_idx], pos[kv_idx])

    tree_causal_pattern.__name__ = f"tree_causal_and_{getattr(pattern, '__name__', 'pattern')}"
    return tree_causal_pattern


def dense_mask(layout: Layout, pattern: Callable | None = None) -> torch.Tensor:
    """BoolTensor [L, L], ``[q, kv]`` True where q may attend kv. Brute force: the test oracle.

    Computed from paths (each token's context is its root-to-leaf prefix), not from the mask_mod.
    """
    L = layout.num_tokens
    m = torch.zeros(L, L, dtype=torch.bool)
    for s in range(layout.num_segments):
        ctx = [t for a in layout.ancestors[s] for t in layout.segment_range(a)]
        for q in layout.segment_range(s):
            m[q, ctx + list(range(layout.starts[s], q + 1))] = True
    if pattern is not None:
        pos = layout.position_ids
        m &= pattern(pos[:, None], pos[None, :]).expand(L, L)
    return m


def block_mask(layout: Layout, pattern: Callable | None = None, device: torch.device | str = "cpu",
               block_size: int = 128):
    """FlexAttention BlockMask of shape (1, 1, L, L), built analytically (cached, LRU of 32).

    See :func:`flexgroup.blockmask.build_block_mask`.
    """
    check_block_size(block_size)
    device = torch.device(device)
    key = (layout, pattern_key(pattern), str(device), block_size)
    bm = _BLOCK_MASKS.get(key)
    if bm is None:
        bm = build_block_mask(layout, pattern, mask_mod(layout, pattern, device), device=device,
                              block_size=block_size)
        _BLOCK_MASKS[key] = bm
        if len(_BLOCK_MASKS) > BLOCK_MASK_CACHE_SIZE:
            _BLOCK_MASKS.popitem(last=False)
    else:
        _BLOCK_MASKS.move_to_end(key)
    return bm


def draw(layout: Layout, pattern: Callable | None = None, block_size: int = 128) -> str:
    """Text drawing of the block mask: ``#`` full block, ``+`` partial block, ``.`` empty."""
    return draw_block_mask(layout, pattern, block_size=block_size)
