"""Analytic BlockMask construction for a :class:`~flexgroup.layout.Layout`.

Each block of ``block_size`` tokens is cut at segment boundaries into *pieces*: runs of tokens of one
segment inside one block, whose virtual positions are contiguous. For a (query piece, key piece)
pair everything is known from a few integers: the key segment must be an ancestor-or-self of the
query segment (Euler-tour interval test), same-segment pairs are causal, and a pattern's
``bounds`` tells whether some / every position pair in the rectangle is allowed. A block pair is

- *empty* when no piece pair in it allows anything,
- *full* when every piece pair in it allows every pair (the mask_mod is then skipped),
- *partial* otherwise (the exact mask_mod decides per element).

This is sound by construction: "any" is never False where an allowed pair exists, "all" is never
True where a forbidden pair exists. Work is proportional to the number of piece pairs inside each
tree (query piece against earlier key pieces of its tree), plus a ``[nb, nb]`` block table -- never
an ``L x L`` tensor.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from .checks import is_int
from .patterns import from_callable

if TYPE_CHECKING:
    from .layout import Layout

__all__ = ["build_block_mask", "block_tables", "draw_block_mask", "check_block_size"]


def check_block_size(block_size) -> int:
    """``block_size`` if it is a positive int, else ValueError naming it."""
    if not is_int(block_size, 1):
        raise ValueError(f"block_size={block_size!r}: give a positive int (128 is FlexAttention's default)")
    return block_size


def block_tables(lay: "Layout", pattern: Callable | None = None, block_size: int = 128
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-level tables ``(any, full)``: BoolTensors [nb, nb] on CPU, ``nb = ceil(L / block_size)``.

    ``any[i, j]``: query block i has at least one allowed key in key block j.
    ``full[i, j]``: every (query, key) pair of the two blocks is allowed.
    """
    check_block_size(block_size)
    pat = from_callable(pattern) if pattern is not None else None
    L, bs = lay.num_tokens, block_size
    nb = -(-L // bs)
    tin_seg, tout_seg = (torch.tensor(x, dtype=torch.long) for x in lay._euler)  # per segment
    seg_starts = torch.tensor(lay.starts, dtype=torch.long)

    # pieces: cut at block starts and segment starts
    p_lo = torch.unique(torch.cat([seg_starts, torch.arange(0, L, bs)]))  # sorted
    p_hi = torch.cat([p_lo[1:], torch.tensor([L])]) - 1  # inclusive
    p_seg = lay._seg_id[p_lo]
    p_blk = torch.div(p_lo, bs, rounding_mode="floor")
    p_pos = lay._position_ids[p_lo]
    p_pos_hi = p_pos + (p_hi - p_lo)
    n_pieces = p_lo.numel()

    # enumerate (q piece, kv piece) with kv piece in [first piece of q's tree, q piece]
    root_start = seg_starts[torch.tensor(lay.component, dtype=torch.long)[p_seg]]
    first = torch.searchsorted(p_lo, root_start)
    counts = torch.arange(n_pieces) - first + 1
    qi = torch.repeat_interleave(torch.arange(n_pieces), counts)
    excl = torch.cumsum(counts, 0) - counts
    ki = first[qi] + (torch.arange(qi.numel()) - excl[qi])

    qs, ks = p_seg[qi], p_seg[ki]
    related = (tin_seg[ks] <= tin_seg[qs]) & (tin_seg[qs] < tout_seg[ks])
    same = ks == qs
    causal_any = ~same | (p_lo[ki] <= p_hi[qi])
    causal_all = ~same | (p_hi[ki] <= p_lo[qi])
    pair_any = related & causal_any
    pair_all = related & causal_all
    if pat is not None:
        b_any, b_all = pat.bounds(p_pos[qi], p_pos_hi[qi], p_pos[ki], p_pos_hi[ki])
        pair_any = pair_any & b_any
        pair_all = pair_all & b_all

    flat = p_blk[qi] * nb + p_blk[ki]
    any_blk = torch.zeros(nb * nb, dtype=torch.bool)
    any_blk[flat[pair_any]] = True
    n_all = torch.zeros(nb * nb, dtype=torch.long).index_add_(
        0, flat[pair_all], torch.ones(int(pair_all.sum()), dtype=torch.long))
    per_blk = torch.bincount(p_blk, minlength=nb)
    need = (per_blk[:, None] * per_blk[None, :]).reshape(-1)
    any_blk = any_blk.view(nb, nb)
    full_blk = (n_all == need).view(nb, nb) & any_blk
    if L % bs:  # a ragged last block is never declared full
        full_blk[-1, :] = False
        full_blk[:, -1] = False
    return any_blk, full_blk


def _to_kv_blocks(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nb, nb] bool -> (num [1, 1, nb] int32, indices [1, 1, nb, nb] int32), columns in increasing order."""
    nb_q, nb_kv = table.shape
    num = table.sum(-1)
    rows, cols = table.nonzero(as_tuple=True)  # row-major, so columns come sorted within a row
    slot = torch.arange(rows.numel()) - (torch.cumsum(num, 0) - num)[rows]
    idx = torch.zeros(nb_q, nb_kv, dtype=torch.int32)
    idx[rows, slot] = cols.to(torch.int32)
    return num.to(torch.int32)[None, None], idx[None, None]


_DIRECT_INIT = "q_indices" in inspect.signature(BlockMask.__init__).parameters


def build_block_mask(lay: "Layout", pattern: Callable | None, mask_mod: Callable,
                     device: torch.device | str = "cpu", block_size: int = 128) -> BlockMask:
    """BlockMask (B=1, H=1, L, L) for ``lay`` with ``pattern``, built analytically; no L x L tensor.

    ``mask_mod`` is the exact mask_mod of the same layout and pattern on ``device`` (applied to
    partial blocks; :func:`flexgroup.masks.mask_mod`).
    The query-side tables (used by the backward pass) are the transposes of the block tables, so
    they are computed here directly instead of by ``BlockMask.from_kv_blocks``.
    """
    any_blk, full_blk = block_tables(lay, pattern, block_size)
    partial = any_blk & ~full_blk
    device = torch.device(device)
    L = lay.num_tokens
    tabs = {}
    for name, t in (("kv", partial), ("full_kv", full_blk), ("q", partial.T), ("full_q", full_blk.T)):
        num, idx = _to_kv_blocks(t.contiguous())
        tabs[name + "_num_blocks"], tabs[name + "_indices"] = num.to(device), idx.to(device)
    if _DIRECT_INIT:
        return BlockMask(seq_lengths=(L, L), BLOCK_SIZE=(block_size, block_size), mask_mod=mask_mod, **tabs)
    return BlockMask.from_kv_blocks(  # older signatures: let torch compute the q side
        tabs["kv_num_blocks"], tabs["kv_indices"], tabs["full_kv_num_blocks"], tabs["full_kv_indices"],
        BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(L, L),
    )


def draw_block_mask(lay: "Layout", pattern: Callable | None = None, block_size: int = 128) -> str:
    """Text drawing: one row per query block; ``#`` full, ``+`` partial, ``.`` empty."""
    any_blk, full_blk = block_tables(lay, pattern, block_size)
    rows = []
    for a_row, f_row in zip(any_blk.tolist(), full_blk.tolist()):
        rows.append("".join("#" if f else ("+" if a else ".") for a, f in zip(a_row, f_row)))
    nb = any_blk.shape[0]
    sparsity = 1.0 - float(any_blk.sum()) / (nb * nb)
    head = f"{lay!r}, block_size={block_size}, {nb}x{nb} blocks, {sparsity:.0%} empty"
    return head + "\n" + "\n".join(rows)
