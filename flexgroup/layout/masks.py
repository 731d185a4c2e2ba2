"""The masks layer: who-attends-to-whom of a :class:`~flexgroup.layout.Layout` as FlexAttention objects.

- :func:`mask_mod`: the exact FlexAttention mask_mod on physical indices (tree-causal rule, and a
  pattern on virtual positions);
- :func:`block_mask`: the analytic BlockMask (:func:`block_pairs`, :func:`build_block_mask`), cached;
- :func:`draw`: a text drawing of the block mask; :func:`dense_mask`: the core's brute-force oracle.

Analytic block tables: each block of ``block_size`` tokens is cut at segment boundaries into
*pieces*: runs of tokens of one segment inside one block, whose virtual positions are contiguous.
For a (query piece, key piece) pair everything is known from a few integers: the key segment must be
an ancestor-or-self of the query segment (Euler-tour interval test, ``Layout.euler_intervals``),
same-segment pairs are causal, and a pattern's ``bounds`` tells whether some / every position pair
in the rectangle is allowed. A block pair is *empty* when no piece pair in it allows anything,
*full* when every piece pair allows every pair (the mask_mod is then skipped), *partial* otherwise.
This is sound by construction ("any" is never False where an allowed pair exists, "all" never True
where a forbidden pair exists); work is proportional to the piece pairs inside each tree (a sparse
list of non-empty block pairs, linear in the row for trees of bounded size) -- never a dense
``[nb, nb]`` table of block states (only :func:`block_tables`, the view for drawings and tests) nor an
``L x L`` tensor. The BlockMask's index tables keep torch's ``[1, 1, nb, nb]`` shape (the compiled
CPU kernel takes the full width) on zeroed memory, and only each row's listed entries and row 0 are
written (:func:`_ordered`): the build is linear in the row, not in ``nb * nb``.

This layer owns its caches (a bounded LRU of block masks keyed by layout value, pattern, device and
block size). A block mask may be cached for any pattern, user callables included: for a callable
pattern the block tables are conservative (never "full", "empty" only by tree structure), and its
mask_mod evaluates the callable at kernel time, so a closure whose captured value changes is read
anew. Kernels that precompute more than that (the sdpa plan) re-plan once per forward instead.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from .checks import is_int, normal_tensors
from .layout import Layout
from .patterns import from_callable

__all__ = ["mask_mod", "block_mask", "dense_mask", "draw", "pattern_key",
           "block_pairs", "block_tables", "build_block_mask", "check_block_size"]

_BLOCK_MASKS: "OrderedDict[tuple, object]" = OrderedDict()
BLOCK_MASK_CACHE_SIZE = 32


def pattern_key(pattern) -> object:
    """A dict key for ``pattern``: the pattern itself when hashable, else its identity."""
    try:
        hash(pattern)
        return pattern
    except TypeError:  # an unhashable user callable: key on identity (the cached mask keeps it alive)
        return ("id", id(pattern))


def mask_mod(layout: Layout, pattern: Callable | None = None, device: torch.device | str = "cpu") -> Callable:
    """FlexAttention mask_mod ``(b, h, q_idx, kv_idx) -> BoolTensor`` on physical indices.

    ``q_idx`` may attend ``kv_idx`` when ``kv_idx <= q_idx`` and the key's segment is an
    ancestor-or-self of the query's (Euler-tour interval test), and ``pattern(q_pos, kv_pos)`` -- on
    virtual positions -- allows it. It reads the layout's per-token ``tin``/``tout`` (and ``pos`` with a
    pattern), LongTensors [L] on ``device`` (on CPU the layout's own cached tensors, never written).
    """
    tin, tout = (x.to(device) for x in layout._euler_tokens)
    pos = layout._position_ids.to(device) if pattern is not None else None

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
    """BoolTensor [L, L]: the brute-force oracle, :meth:`Layout.dense_mask` (the core owns it)."""
    return layout.dense_mask(pattern)


@normal_tensors  # cached: built outside inference mode
def block_mask(layout: Layout, pattern: Callable | None = None, device: torch.device | str = "cpu",
               block_size: int = 128):
    """FlexAttention BlockMask of shape (1, 1, L, L), built analytically.

    Cached (LRU of ``BLOCK_MASK_CACHE_SIZE`` = 32, flexgroup/caches.py) when ``pattern`` is None or one of
    flexgroup's own frozen patterns; a user callable's mask is built anew on every call (its answers may change).

    See :func:`build_block_mask`.
    """
    check_block_size(block_size)
    device = torch.device(device)
    if not (pattern is None or getattr(pattern, "frozen", False)):  # a user callable may change: never cached
        return build_block_mask(layout, pattern, mask_mod(layout, pattern, device), device=device, block_size=block_size)
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
    """Text drawing of the block mask: one row per query block; ``#`` full, ``+`` partial, ``.`` empty."""
    any_blk, full_blk = block_tables(layout, pattern, block_size)
    rows = []
    for a_row, f_row in zip(any_blk.tolist(), full_blk.tolist()):
        rows.append("".join("#" if f else ("+" if a else ".") for a, f in zip(a_row, f_row)))
    nb = any_blk.shape[0]
    sparsity = 1.0 - float(any_blk.sum()) / (nb * nb)
    head = f"{layout!r}, block_size={block_size}, {nb}x{nb} blocks, {sparsity:.0%} empty"
    return head + "\n" + "\n".join(rows)


# ---------------------------------------------------------------------------- analytic block tables
def check_block_size(block_size) -> int:
    """``block_size`` if it is a positive int, else ValueError naming it."""
    if not is_int(block_size, 1):
        raise ValueError(f"block_size={block_size!r}: give a positive int (128 is FlexAttention's default)")
    return block_size


def block_pairs(lay: Layout, pattern: Callable | None = None, block_size: int = 128
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The non-empty block pairs of ``lay`` with ``pattern``, sparse: ``(q, kv, full, nb)``.

    ``q``, ``kv``: LongTensors [P], the query and key block of each pair that holds at least one allowed
    (query, key) pair, sorted by ``(q, kv)``; ``full``: BoolTensor [P], every pair of the two blocks is
    allowed; ``nb = ceil(L / block_size)``. Work and memory are linear in the piece pairs inside each
    tree (no ``[nb, nb]`` table).
    """
    check_block_size(block_size)
    pat = from_callable(pattern) if pattern is not None else None
    L, bs = lay.num_tokens, block_size
    nb = -(-L // bs)
    tin_seg, tout_seg = (torch.tensor(x, dtype=torch.long) for x in lay.euler_intervals)  # per segment
    seg_starts = torch.tensor(lay.starts, dtype=torch.long)

    # pieces: cut at block starts and segment starts
    p_lo = torch.unique(torch.cat([seg_starts, torch.arange(0, L, bs)]))  # sorted
    p_hi = torch.cat([p_lo[1:], torch.tensor([L])]) - 1  # inclusive
    p_seg = torch.searchsorted(seg_starts, p_lo, right=True) - 1  # no per-token table
    p_blk = torch.div(p_lo, bs, rounding_mode="floor")
    p_pos = torch.tensor(lay.offsets, dtype=torch.long)[p_seg] + (p_lo - seg_starts[p_seg])
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

    # one entry per enumerated block pair: non-empty if any piece pair allows something, full if every
    # piece pair of the two blocks (per_blk[q] * per_blk[kv] of them) allows everything
    flat, inv = torch.unique(p_blk[qi] * nb + p_blk[ki], return_inverse=True)  # sorted by (q, kv)
    n_any = torch.zeros(flat.numel(), dtype=torch.long).index_add_(0, inv, pair_any.long())
    n_all = torch.zeros(flat.numel(), dtype=torch.long).index_add_(0, inv, pair_all.long())
    flat, n_all = flat[n_any > 0], n_all[n_any > 0]
    q, kv = torch.div(flat, nb, rounding_mode="floor"), flat % nb
    per_blk = torch.bincount(p_blk, minlength=nb)
    full = n_all == per_blk[q] * per_blk[kv]
    if L % bs:  # a ragged last block is never declared full
        full &= (q != nb - 1) & (kv != nb - 1)
    return q, kv, full, nb


def block_tables(lay: Layout, pattern: Callable | None = None, block_size: int = 128
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense block tables ``(any, full)``: BoolTensors [nb, nb] on CPU, ``nb = ceil(L / block_size)``.

    ``any[i, j]``: query block i has at least one allowed key in key block j.
    ``full[i, j]``: every (query, key) pair of the two blocks is allowed.
    The dense view of :func:`block_pairs` (``nb * nb`` memory: for drawings and tests).
    """
    q, kv, full, nb = block_pairs(lay, pattern, block_size)
    any_blk = torch.zeros(nb, nb, dtype=torch.bool)
    any_blk[q, kv] = True
    full_blk = torch.zeros(nb, nb, dtype=torch.bool)
    full_blk[q[full], kv[full]] = True
    return any_blk, full_blk


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    """IntTensor [n] of zeros on ``device``. On CPU an anonymous memory map: the OS hands its pages
    out zeroed when first written, so a block table costs its written pages, not its ``nb * nb`` entries
    (``torch.zeros`` would write them all; ``torch.empty`` may return an earlier table's bytes)."""
    if device.type != "cpu":
        return torch.zeros(n, dtype=torch.int32, device=device)
    buf = mmap.mmap(-1, 4 * n)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # a 2 MiB page would zero 2 MiB for the few entries of one row
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.int32)  # the tensor keeps ``buf`` alive


def _ordered(rows: torch.Tensor, cols: torch.Tensor, nb: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by (row, col) -> (num [1, 1, nb] int32, indices [1, 1, nb, nb] int32) on ``device``.

    ``indices[0, 0, r, :num[r]]`` are row r's columns in increasing order, as torch lists them. Row 0
    is written in full as torch's ``create_block_mask`` writes every row (its ``_dense_to_ordered``:
    then the columns the row does not list, in increasing order): torch 2.6's compiled CPU kernel
    reads row 0 to its full width (a paged-KV probe: a repeated 0 there makes it attend to the first
    key blocks only). Every other entry past a row's count is 0 (no kernel reads it). Written at the
    pairs only (and row 0), on zeroed memory: O(pairs + nb), not O(nb^2).
    """
    num = torch.bincount(rows, minlength=nb)
    slot = torch.arange(rows.numel()) - (torch.cumsum(num, 0) - num)[rows]
    idx = _zeros(nb * nb, device)
    idx[(rows * nb + slot).to(device)] = cols.to(device=device, dtype=torch.int32)
    unlisted = torch.ones(nb, dtype=torch.bool)
    unlisted[cols[: int(num[0])]] = False
    idx[int(num[0]): nb] = unlisted.nonzero().view(-1).to(device=device, dtype=torch.int32)
    return num.to(device=device, dtype=torch.int32)[None, None], idx.view(1, 1, nb, nb)


def build_block_mask(lay: Layout, pattern: Callable | None, mask_mod: Callable,
                     device: torch.device | str = "cpu", block_size: int = 128) -> BlockMask:
    """BlockMask (B=1, H=1, L, L) for ``lay`` with ``pattern``, built analytically; no L x L tensor.

    ``mask_mod`` is the exact mask_mod of the same layout and pattern on ``device`` (applied to
    partial blocks; :func:`mask_mod`). The eight tables are those of torch's ``create_block_mask``
    (``kv_num_blocks`` [1, 1, nb] and ``kv_indices`` [1, 1, nb, nb] int32, and so for ``full_kv``, ``q``,
    ``full_q``) up to each row's count, and row 0 in full (:func:`_ordered`). The query side (read by
    the backward pass) is the same pairs sorted by key block, so it is built here directly instead of
    by ``BlockMask.from_kv_blocks``. O(pairs + nb) from the sparse :func:`block_pairs`.
    """
    q, kv, full, nb = block_pairs(lay, pattern, block_size)
    device = torch.device(device)
    L = lay.num_tokens
    by_kv = torch.argsort(kv * nb + q)  # the query side: the same pairs sorted by (kv, q)
    full_t = full[by_kv]
    tabs = {}
    for name, rows, cols in (("kv", q[~full], kv[~full]), ("full_kv", q[full], kv[full]),
                             ("q", kv[by_kv][~full_t], q[by_kv][~full_t]),
                             ("full_q", kv[by_kv][full_t], q[by_kv][full_t])):
        tabs[name + "_num_blocks"], tabs[name + "_indices"] = _ordered(rows, cols, nb, device)
    return BlockMask(seq_lengths=(L, L), BLOCK_SIZE=(block_size, block_size), mask_mod=mask_mod, **tabs)
