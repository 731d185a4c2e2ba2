"""Block-mask construction (issue 2's target): a 65,536-token row of 64 groups (prefix 512,
8 responses of 64), flexgroup's analytic builder versus compiled ``create_block_mask`` in one run.
Target: analytic <= 20 ms and >= 25x faster than the compiled builder (reported, not asserted).

The compiled builder is O(L^2) (about a minute per call on 2 shared CPU cores at this size), so it
gets one timed round after its compile. Each analytic round builds a fresh Layout (Layout caches its block masks), so the per-token
metadata is recomputed too. The two masks are compared block by block before anything is timed.

    pytest benchmarks/test_blockmask.py --benchmark-only
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from flexgroup import Layout
from flexgroup.layout import masks
from flexgroup.layout.masks import build_block_mask

GROUPS, PREFIX, G, RESP, BS = 64, 512, 8, 64, 128
_STATE: dict = {}


def make_layout() -> Layout:
    return Layout.pack([Layout.group(PREFIX, [RESP] * G) for _ in range(GROUPS)])


def _tables(bm) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, full) block tables [nb, nb] of a BlockMask, from its kv tables."""
    def dense(num, idx):
        nb = idx.shape[-2]
        out = torch.zeros(nb, idx.shape[-1] + 1, dtype=torch.bool)
        cols = torch.where(torch.arange(idx.shape[-1])[None] < num[0, 0][:, None].long(), idx[0, 0].long(),
                           idx.shape[-1])
        out.scatter_(1, cols, True)
        return out[:, :-1]

    full = dense(bm.full_kv_num_blocks, bm.full_kv_indices) if bm.full_kv_num_blocks is not None else None
    part = dense(bm.kv_num_blocks, bm.kv_indices)
    return part | (full if full is not None else False), full


@pytest.fixture(scope="module")
def compiled_builder():
    """torch.compile(create_block_mask), its first-call (compile) time, and one mask for the check."""
    lay = make_layout()
    L = lay.num_tokens
    assert L == 65536
    build = torch.compile(create_block_mask)
    t0 = time.perf_counter()
    ref = build(masks.mask_mod(lay), 1, 1, L, L, device="cpu", BLOCK_SIZE=BS)
    first = time.perf_counter() - t0
    lay2 = make_layout()
    mine = build_block_mask(lay2, None, masks.mask_mod(lay2), device="cpu", block_size=BS)
    a_ref, f_ref = _tables(ref)
    a_mine, f_mine = _tables(mine)
    assert torch.equal(a_ref, a_mine), "analytic and compiled block masks select different blocks"
    if f_ref is not None:
        assert torch.equal(f_ref, f_mine), "analytic and compiled block masks disagree on full blocks"
    return build, first


def test_blockmask_compiled(benchmark, compiled_builder):
    build, first = compiled_builder
    lay = make_layout()
    mod, L = masks.mask_mod(lay), lay.num_tokens
    benchmark.group = "block mask 65,536 tokens, 64 groups"
    benchmark.pedantic(lambda: build(mod, 1, 1, L, L, device="cpu", BLOCK_SIZE=BS), rounds=1,
                       warmup_rounds=0, iterations=1)
    _STATE["compiled"] = benchmark.stats.stats.median
    benchmark.extra_info.update(first_call_s=first, tokens=L, threads=torch.get_num_threads())


def test_blockmask_analytic(benchmark, compiled_builder):
    benchmark.group = "block mask 65,536 tokens, 64 groups"
    benchmark.pedantic(lambda lay: build_block_mask(lay, None, masks.mask_mod(lay), device="cpu", block_size=BS),
                       setup=lambda: ((make_layout(),), {}), rounds=20, warmup_rounds=2, iterations=1)
    med = benchmark.stats.stats.median
    extra = dict(tokens=GROUPS * (PREFIX + G * RESP), target_ms=20, target_speedup=25,
                 threads=torch.get_num_threads(), median_ms=med * 1e3)
    if "compiled" in _STATE:
        extra["speedup_vs_compiled"] = _STATE["compiled"] / med
    benchmark.extra_info.update(extra)
