"""Acceptance tests for the analytic block masks: soundness against the dense oracle, agreement with
torch's ``create_block_mask``, the BlockMask object, and the text drawing."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from flexgroup import Layout, patterns as P
from flexgroup.layout import masks
from flexgroup.layout.masks import block_tables

from _core_reference import one_torch_thread  # noqa: F401  (autouse fixture)
from _core_reference import PATTERNS, layouts, ref_dense_mask

BLOCK_SIZES = [1, 2, 16, 128]
SETTINGS = settings(max_examples=60, deadline=None)


def dense_block_tables(dense: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all) per (query block, key block) of an [L, L] oracle; padding counts as forbidden."""
    L = dense.shape[0]
    nb = -(-L // bs)
    pad = torch.zeros(nb * bs, nb * bs, dtype=torch.bool)
    pad[:L, :L] = dense
    blocks = pad.view(nb, bs, nb, bs).permute(0, 2, 1, 3).reshape(nb, nb, bs * bs)
    return blocks.any(-1), blocks.all(-1)


def tables_of(bm: BlockMask) -> tuple[torch.Tensor, torch.Tensor]:
    """(non-empty, full) [nb, nb] tables read back from a BlockMask's kv-side indices."""
    def dense(num, idx):
        nb = idx.shape[-2]
        t = torch.zeros(nb, idx.shape[-1], dtype=torch.bool)
        for r in range(nb):
            t[r, idx[0, 0, r, : int(num[0, 0, r])].long()] = True
        return t

    partial = dense(bm.kv_num_blocks, bm.kv_indices)
    full = dense(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert not (partial & full).any(), "a block is listed both as partial and as full"
    return partial | full, full


@SETTINGS
@given(layouts(max_segments=8, max_len=64, max_tokens=160), st.sampled_from(sorted(PATTERNS)),
       st.sampled_from(BLOCK_SIZES))
def test_block_mask_keeps_every_allowed_block_and_marks_no_forbidden_block_full(lay, name, bs):
    pattern, exact = PATTERNS[name]
    want_any, want_all = dense_block_tables(ref_dense_mask(lay.parents, lay.lengths, pattern), bs)
    got_any, got_full = tables_of(masks.block_mask(lay, pattern, block_size=bs))
    assert not (want_any & ~got_any).any(), "a block holding an allowed pair was left out"
    assert not (got_full & ~want_all).any(), "a block marked full holds a forbidden pair"
    if exact:
        assert torch.equal(got_any, want_any)


@SETTINGS
@given(layouts(max_segments=8, max_len=64, max_tokens=160), st.sampled_from(sorted(PATTERNS)),
       st.sampled_from(BLOCK_SIZES))
def test_non_empty_blocks_agree_with_torch_create_block_mask(lay, name, bs):
    # Exact equality for built-in patterns (their block bounds are exact). A user callable has no
    # bounds and an and-composition only an upper bound on "any", so for those the analytic mask may
    # keep extra (partial) blocks -- a superset, still exact because the mask_mod runs on them.
    pattern, exact = PATTERNS[name]
    L = lay.num_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = create_block_mask(masks.mask_mod(lay, pattern), 1, 1, L, L, device="cpu", BLOCK_SIZE=bs)
    ref_any = ref.to_dense()[0, 0] > 0
    ours = masks.block_mask(lay, pattern, block_size=bs)
    got_any = ours.to_dense()[0, 0] > 0
    assert ours.shape == ref.shape == (1, 1, L, L)
    if exact:
        assert torch.equal(got_any, ref_any)
    else:
        assert not (ref_any & ~got_any).any()
    ref_full = tables_of(ref)[1]
    assert not (tables_of(ours)[1] & ~ref_full).any()


@settings(max_examples=25, deadline=None)
@given(layouts(max_segments=8, max_len=64, max_tokens=300), st.sampled_from(sorted(PATTERNS)),
       st.sampled_from(BLOCK_SIZES))
def test_query_side_tables_are_the_transpose_of_the_key_side(lay, name, bs):
    pattern = PATTERNS[name][0]
    bm = masks.block_mask(lay, pattern, block_size=bs)
    ref = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                   BLOCK_SIZE=bs, mask_mod=bm.mask_mod, seq_lengths=(lay.num_tokens,) * 2)
    for num, idx in (("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        assert torch.equal(getattr(bm, num), getattr(ref, num))
        n = getattr(bm, num)[0, 0]
        for r in range(n.numel()):
            k = int(n[r])
            assert torch.equal(getattr(bm, idx)[0, 0, r, :k], getattr(ref, idx)[0, 0, r, :k])


def test_block_mask_object_has_the_row_shape_block_size_and_exact_mask_mod():
    lay = Layout.group(5, [3, 4])
    bm = masks.block_mask(lay, P.sliding_window(3), block_size=4)
    assert bm.shape == (1, 1, 12, 12)
    assert bm.BLOCK_SIZE == (4, 4)
    assert bm.kv_indices.dtype == torch.int32 and bm.kv_num_blocks.shape == (1, 1, 3)
    i = torch.arange(12)
    got = bm.mask_mod(0, 0, i[:, None], i[None, :])
    assert torch.equal(got, ref_dense_mask(lay.parents, lay.lengths, P.sliding_window(3)))


def test_block_masks_are_cached_per_pattern_device_and_block_size():
    lay = Layout.group(6, [2, 2])
    w = P.sliding_window(2)
    assert masks.block_mask(lay, w, block_size=4) is masks.block_mask(lay, P.sliding_window(2), block_size=4)
    assert masks.block_mask(lay, w, block_size=4) is not masks.block_mask(lay, w, block_size=8)
    assert masks.block_mask(lay, None) is not masks.block_mask(lay, w)


def test_unhashable_user_patterns_work_and_are_never_cached():
    # the one cache policy (flexgroup/caches.py): no process-wide cache is keyed on a user callable
    # (this one is mutable: eq=True without frozen); frozen patterns are still cached by value
    @dataclass
    class EvenDistance:  # eq=True without frozen: instances are unhashable
        m: int = 2

        def __call__(self, q_pos, kv_pos):
            return (q_pos - kv_pos) % self.m == 0

    lay = Layout.group(4, [3, 3])
    pat = EvenDistance()
    masks._BLOCK_MASKS.clear()
    bm = masks.block_mask(lay, pat, block_size=2)
    assert masks.block_mask(lay, P.from_callable(pat), block_size=2) is not bm
    masks.block_mask(lay, P.chunked(2) & pat, block_size=2)
    assert not masks._BLOCK_MASKS
    assert masks.block_mask(lay, P.chunked(2), block_size=2) is masks.block_mask(lay, P.chunked(2), block_size=2)
    i = torch.arange(lay.num_tokens)
    assert torch.equal(bm.mask_mod(0, 0, i[:, None], i[None, :]), ref_dense_mask(lay.parents, lay.lengths, pat))
    pat.m = 3  # a changed answer: a fresh mask reads it
    bm3 = masks.block_mask(lay, pat, block_size=2)
    assert torch.equal(bm3.mask_mod(0, 0, i[:, None], i[None, :]), ref_dense_mask(lay.parents, lay.lengths, pat))


@pytest.mark.parametrize("bs", [0, -1, 1.5, True, "128"])
def test_bad_block_size_raises_value_error_naming_it(bs):
    lay = Layout.group(2, [1])
    masks.block_mask(lay, block_size=1)  # a cached entry that a bad value must not alias (True == 1)
    with pytest.raises(ValueError, match="block_size="):
        masks.block_mask(lay, block_size=bs)


def test_a_long_row_gets_a_block_mask_without_an_l_by_l_tensor():
    lay = Layout.pack([Layout.group(512, [64] * 8)] * 16)  # 16,384 tokens
    bm = masks.block_mask(lay)
    nb = lay.num_tokens // 128
    assert bm.kv_indices.shape == (1, 1, nb, nb)
    any_, full = block_tables(lay)
    # per group: the 4x4 prompt blocks are causal (4 diagonal partial + 6 full), and each response
    # block sees the 4 prompt blocks in full and is itself partial (64-token responses share blocks)
    assert int(any_.sum()) == 16 * (10 + 4 * (4 + 1))
    assert int(full.sum()) == 16 * (6 + 4 * 4)


# ------------------------------------------------------------------ drawing


def test_draw_shows_full_partial_and_empty_blocks():
    lay = Layout.group(5, [3, 4])
    assert masks.draw(lay, block_size=2) == "\n".join([
        "Layout(parents=[-1, 0, 0], lengths=[5, 3, 4]), block_size=2, 6x6 blocks, 47% empty",
        "+.....",
        "#+....",
        "##+...",
        "###+..",
        "##+.+.",
        "##+.#+",
    ])


def test_draw_applies_the_pattern():
    lay = Layout.group(4, [4])
    assert masks.draw(lay, P.sliding_window(2), block_size=2).splitlines()[1:] == [
        "+...",
        "++..",
        ".++.",
        "..++",
    ]


def test_the_masks_are_functions_of_the_layout_not_methods_attached_to_it():
    # masks is imported (above): the Layout value stays free of the FlexAttention layer's functions
    assert not any(hasattr(Layout, name) for name in ("block_mask", "mask_mod", "draw"))
