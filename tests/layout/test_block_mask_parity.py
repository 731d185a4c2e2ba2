"""Exact parity of the sparse block-mask build with torch's ``create_block_mask`` on the same mask_mod:
every table (partial and full, key side and query side) as sets of block pairs, on random layouts and
patterns and on long packed rows where the non-empty pairs are a small fraction of ``nb * nb``."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from flexgroup import Layout, patterns as P
from flexgroup.layout import masks

from _core_reference import one_torch_thread  # noqa: F401  (autouse fixture)
from _core_reference import PATTERNS, layouts

EXACT = sorted(name for name, (_, exact) in PATTERNS.items() if exact)


def pairs(num: torch.Tensor, idx: torch.Tensor) -> set[tuple[int, int]]:
    """The (row, column) block pairs a [1, 1, rows] count and [1, 1, rows, cols] index table list."""
    out = set()
    for r, k in enumerate(num[0, 0].tolist()):
        row = idx[0, 0, r, :k].tolist()
        assert len(set(row)) == k, f"row {r} lists a block twice: {row}"
        out.update((r, c) for c in row)
    return out


def assert_same_tables(ours: BlockMask, ref: BlockMask) -> None:
    assert ours.shape == ref.shape and ours.BLOCK_SIZE == ref.BLOCK_SIZE
    for side in ("kv", "full_kv", "q", "full_q"):
        got = pairs(getattr(ours, side + "_num_blocks"), getattr(ours, side + "_indices"))
        want = pairs(getattr(ref, side + "_num_blocks"), getattr(ref, side + "_indices"))
        assert got == want, f"{side}: {len(got - want)} extra and {len(want - got)} missing block pairs"
    for side in ("kv", "full_kv", "q", "full_q"):  # each row's indices come in increasing order
        num, idx = getattr(ours, side + "_num_blocks")[0, 0], getattr(ours, side + "_indices")[0, 0]
        for r, k in enumerate(num.tolist()):
            assert idx[r, :k].tolist() == sorted(idx[r, :k].tolist())


def reference(lay: Layout, pattern, bs: int) -> BlockMask:
    L = lay.num_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return create_block_mask(masks.mask_mod(lay, pattern), 1, 1, L, L, device="cpu", BLOCK_SIZE=bs)


@settings(max_examples=80, deadline=None)
@given(layouts(max_segments=10, max_len=80, max_tokens=400), st.sampled_from(EXACT), st.sampled_from([1, 4, 16, 32]))
def test_every_block_table_equals_create_block_mask_on_random_layouts(lay, name, bs):
    lay, _ = masks.padded_layout(lay, bs)  # as flex_inputs builds it: whole blocks only
    pattern = PATTERNS[name][0]
    assert_same_tables(masks.build_block_mask(lay, pattern, masks.mask_mod(lay, pattern), block_size=bs),
                       reference(lay, pattern, bs))


@pytest.mark.parametrize("pattern", [None, P.sliding_window(40), P.chunked(96), P.sliding_window(7) | P.chunked(32)],
                         ids=["causal", "window_40", "chunked_96", "window_or_chunk"])
def test_a_long_packed_row_has_the_block_tables_of_create_block_mask(pattern):
    # 24 trees of 352 tokens (8,448): each query block sees a few key blocks of its own tree, so the
    # pairs are ~5% of nb * nb -- the regime of a half-million-token row, at a size the oracle can build
    lay = Layout.pack([Layout.tree([-1, 0, 0, 1, 1], [96, 64, 80, 56, 56]) for _ in range(24)])
    lay, _ = masks.padded_layout(lay, 16)
    q, _, _, nb = masks.block_pairs(lay, pattern, 16)
    assert q.numel() < 0.1 * nb * nb
    assert_same_tables(masks.build_block_mask(lay, pattern, masks.mask_mod(lay, pattern), block_size=16),
                       reference(lay, pattern, 16))


@settings(max_examples=40, deadline=None)
@given(layouts(max_segments=8, max_len=64, max_tokens=300), st.sampled_from(sorted(PATTERNS)),
       st.sampled_from([1, 3, 16, 128]))
def test_block_pairs_are_the_non_empty_and_full_entries_of_the_dense_tables(lay, name, bs):
    q, kv, full, nb = masks.block_pairs(lay, PATTERNS[name][0], bs)
    any_blk, full_blk = masks.block_tables(lay, PATTERNS[name][0], bs)
    assert nb == -(-lay.num_tokens // bs)
    flat = q * nb + kv
    assert torch.equal(flat, torch.unique(flat)), "pairs are not sorted by (q, kv) or repeat"
    assert torch.equal(any_blk.nonzero(), torch.stack([q, kv], 1))
    assert torch.equal(full_blk.nonzero(), torch.stack([q[full], kv[full]], 1))
