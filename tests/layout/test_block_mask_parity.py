"""Exact parity of the sparse block-mask build with torch's ``create_block_mask`` on the same mask_mod.

Every table (partial and full, key side and query side): the same count per row and the same indices,
in torch's order, up to each row's count -- the entries every kernel reads. Row 0 must equal torch's
to its full width (torch lists there, after the row's blocks, every other block in increasing order):
torch 2.6's compiled CPU kernel scans it (a paged-KV probe), and a tail of zeros made it attend to the
first key block only (tests/kernels/test_attention.py runs that kernel on these tables). Every other
entry past a row's count is 0 (no kernel reads it; it must not be an earlier table's bytes).
Random layouts and patterns, and long packed rows where the non-empty pairs are a small fraction of
``nb * nb``."""

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
SIDES = ("kv", "full_kv", "q", "full_q")


def assert_same_tables(ours: BlockMask, ref: BlockMask) -> None:
    assert ours.shape == ref.shape and ours.BLOCK_SIZE == ref.BLOCK_SIZE
    for side in SIDES:
        num, idx = getattr(ours, side + "_num_blocks"), getattr(ours, side + "_indices")
        ref_num, ref_idx = getattr(ref, side + "_num_blocks"), getattr(ref, side + "_indices")
        assert num.dtype == idx.dtype == torch.int32 and idx.is_contiguous()
        assert num.shape == ref_num.shape and idx.shape == ref_idx.shape, side
        assert torch.equal(num, ref_num), f"{side}: counts differ in rows {(num != ref_num).nonzero()[:5].tolist()}"
        listed = torch.arange(idx.shape[-1]) < num[..., None]  # [1, 1, rows, cols]: entries up to the count
        bad = (listed & (idx != ref_idx)).nonzero()
        assert bad.numel() == 0, f"{side}: listed indices differ from torch's at {bad[:5].tolist()}"
        assert torch.equal(idx[0, 0, 0], ref_idx[0, 0, 0]), f"{side}: row 0 differs from torch's past its count"
        tail = ~listed
        tail[0, 0, 0] = False
        assert not bool(idx[tail].any()), f"{side}: entries past a row's count are not 0"


def reference(lay: Layout, pattern, bs: int) -> BlockMask:
    L = lay.num_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return create_block_mask(masks.mask_mod(lay, pattern), 1, 1, L, L, device="cpu", BLOCK_SIZE=bs)


def ours(lay: Layout, pattern, bs: int) -> BlockMask:
    return masks.build_block_mask(lay, pattern, masks.mask_mod(lay, pattern), block_size=bs)


@settings(max_examples=80, deadline=None)
@given(layouts(max_segments=10, max_len=80, max_tokens=400), st.sampled_from(EXACT), st.sampled_from([1, 4, 16, 32]))
def test_every_block_table_equals_create_block_mask_on_random_layouts(lay, name, bs):
    lay = lay.padded(bs)  # as flex_inputs builds it: whole blocks only
    pattern = PATTERNS[name][0]
    assert_same_tables(ours(lay, pattern, bs), reference(lay, pattern, bs))


@pytest.mark.parametrize("pattern", [None, P.sliding_window(40), P.chunked(96), P.sliding_window(7) | P.chunked(32)],
                         ids=["causal", "window_40", "chunked_96", "window_or_chunk"])
def test_a_long_packed_row_has_the_block_tables_of_create_block_mask(pattern):
    # 24 trees of 352 tokens (8,448): each query block sees a few key blocks of its own tree, so the
    # pairs are ~5% of nb * nb -- the regime of a half-million-token row, at a size the oracle can build
    lay = Layout.pack([Layout.tree([-1, 0, 0, 1, 1], [96, 64, 80, 56, 56]) for _ in range(24)])
    lay = lay.padded(16)
    q, _, _, nb = masks.block_pairs(lay, pattern, 16)
    assert q.numel() < 0.1 * nb * nb
    assert_same_tables(ours(lay, pattern, 16), reference(lay, pattern, 16))


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("broken", ["row_0_tail_zero", "listed_swapped", "tail_not_zero"])
def test_the_parity_check_catches_a_wrong_table(side, broken):
    lay = Layout.pack([Layout.group(40, [17, 30, 9]), Layout.tree([-1, 0, 0], [20, 5, 6])])
    lay = lay.padded(16)
    bm, ref = ours(lay, None, 16), reference(lay, None, 16)
    num, idx = getattr(bm, side + "_num_blocks")[0, 0], getattr(bm, side + "_indices")[0, 0]
    if broken == "row_0_tail_zero":  # the tables of the reverted sparse build (torch 2.6: wrong numbers)
        idx[0, int(num[0]):] = 0
    elif broken == "listed_swapped":
        r = int(torch.nonzero(num >= 2)[0])
        idx[r, :2] = idx[r, :2].flip(0)
    else:
        r = int(torch.nonzero(num < num.numel())[-1])
        idx[r, -1] = 1
    with pytest.raises(AssertionError):
        assert_same_tables(bm, ref)


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
