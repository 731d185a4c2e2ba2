"""The ``lse`` backend's grid plan: a query's attention is bitwise a function of its own path (issue 43).

The grid cuts each query's keys at multiples of ``lse_plan.CHUNK`` virtual positions, so the parts a query's
row runs in are the same whatever trie its sequence is packed in (:func:`flexgroup.kernels.lse_plan.grid_parts`).
Here q/k/v are made per token as a function of the token's whole prefix -- what a real model's are -- and a
set of sequences is packed alone, beside others that share prefixes with it (so the trie's segments move),
and in part; each sequence's attention output is compared with ``torch.equal``. The plan leans on two
properties of torch's fused CPU kernel, checked first: they are what a future torch could break.
"""

from __future__ import annotations

import pytest
import torch
from _core_reference import one_torch_thread  # noqa: F401  (autouse fixture)
from hypothesis import given, settings, strategies as st

from flexgroup import GroupedBatch, Layout, attention, patterns
from flexgroup.kernels import lse, lse_ops, lse_plan

HQ, HKV, D = 4, 2, 16
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _rows_of(x: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return x[:, :, start:start + count]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_fused_kernel_gives_a_query_row_the_same_bits_wherever_the_grid_puts_it(dtype):
    g = torch.Generator().manual_seed(0)
    # a full cell: the same 8 query rows among other rows, at other offsets, in calls of other sizes (multiples of 8)
    k, v = (torch.randn(1, HKV, 256, 64, generator=g).to(dtype) for _ in range(2))
    mine = torch.randn(1, HQ, 8, 64, generator=g).to(dtype)
    seen = []
    for M, off in ((8, 0), (16, 8), (40, 16), (200, 96), (264, 256), (800, 392)):
        q = torch.randn(1, HQ, M, 64, generator=g).to(dtype)
        q[:, :, off:off + 8] = mine
        o, l, _ = lse_ops.part_forward(q, k, v, causal=False, scale=0.125)
        seen.append((_rows_of(o, off, 8), _rows_of(l, off, 8)))
    assert all(torch.equal(o, seen[0][0]) and torch.equal(l, seen[0][1]) for o, l in seen)
    # a causal square: batch entries are independent
    q, k, v = (torch.randn(3, h, 32, 64, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    o, _, _ = lse_ops.part_forward(q, k, v, causal=True, scale=0.125)
    one, _, _ = lse_ops.part_forward(q[1:2], k[1:2], v[1:2], causal=True, scale=0.125)
    assert torch.equal(one, o[1:2])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_row_no_mask_cuts_gets_the_same_bits_with_a_zero_bias_as_without(dtype):
    """A pattern masks only the calls it cuts, so a row can run masked in one packing and mask-free in another."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, HQ, 40, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, HKV, 96, 64, generator=g).to(dtype) for _ in range(2))
    bias = torch.zeros(1, 1, 40, 96, dtype=dtype)
    bias[..., 5:, -3:] = float("-inf")                          # rows 5.. cut; rows 0-4 see every key
    o, l, _ = lse_ops.part_forward(q, k, v, causal=False, scale=0.125)
    om, lm, _ = lse_ops.part_forward(q, k, v, causal=False, scale=0.125, bias=bias)
    assert torch.equal(o[:, :, :5], om[:, :, :5]) and torch.equal(l[:, :, :5], lm[:, :, :5])
    # a causal square against the same square under a window of 20 as a mask: rows 0-19 are not cut
    q, k, v = (torch.randn(2, h, 32, 64, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    r = torch.arange(32)
    allowed = (r[:, None] >= r[None, :]) & (r[:, None] - r[None, :] < 20)
    bias = torch.zeros(2, 1, 32, 32, dtype=dtype).masked_fill(~allowed, float("-inf"))
    o, l, _ = lse_ops.part_forward(q, k, v, causal=True, scale=0.125)
    om, lm, _ = lse_ops.part_forward(q, k, v, causal=False, scale=0.125, bias=bias)
    assert torch.equal(o[:, :, :20], om[:, :, :20]) and torch.equal(l[:, :, :20], lm[:, :, :20])


def _token_qkv(batch: GroupedBatch, dtype) -> list[torch.Tensor]:
    """q ``[1, HQ, L, D]``, k, v ``[1, HKV, L, D]``: each token's vectors a function of its prefix (as a model's)."""
    L = batch.layout.num_tokens
    q, k, v = torch.empty(HQ, L, D), torch.empty(HKV, L, D), torch.empty(HKV, L, D)
    done = torch.zeros(L, dtype=torch.bool)
    for path in batch.paths:
        ids = batch.input_ids[path].tolist()
        for t, row in enumerate(path.tolist()):
            if done[row]:
                continue
            g = torch.Generator().manual_seed(hash(tuple(ids[:t + 1])) & 0x7FFFFFFF)
            q[:, row], k[:, row], v[:, row] = (torch.randn(h, D, generator=g) for h in (HQ, HKV, HKV))
            k[:, row] += 4.0                 # a common key component, as real checkpoints have
            done[row] = True
    return [x[None].to(dtype) for x in (q, k, v)]


def _outputs(sequences: list[torch.Tensor], dtype, pattern=None) -> dict[tuple, torch.Tensor]:
    """Each distinct sequence's attention output ``[HQ, n, D]`` under the lse backend, keyed by its tokens."""
    batch = GroupedBatch.from_sequences(sequences)
    out = attention(*_token_qkv(batch, dtype), batch.layout, pattern=pattern, backend="lse")[0]
    return {tuple(batch.input_ids[p].tolist()): out[:, p] for p in batch.paths}


def _assert_same(alone: dict, packed: dict, where: str) -> None:
    for key, o in packed.items():
        if key in alone:
            assert torch.equal(alone[key], o), f"{where}: max |diff| {(alone[key].float() - o.float()).abs().max():.3g}"


sequences = st.lists(st.lists(st.integers(1, 3), min_size=2, max_size=150), min_size=1, max_size=5)


@pytest.mark.parametrize("window", [None, 11])
@pytest.mark.parametrize("chunk", [4, 16, 64])     # 64: cells of 64 cut again into sub-cells of 32
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@settings(max_examples=30, deadline=None)
@given(mine=sequences, others=sequences, split=st.integers(0, 4))
def test_a_sequences_attention_depends_only_on_its_own_path(window, chunk, dtype, mine, others, split):
    # tokens from {1, 2, 3}: the sequences share prefixes of every length with each other and with the others
    lse_plan.CHUNK, old = chunk, lse_plan.CHUNK
    try:
        a = [torch.tensor(s) for s in mine]
        b = [torch.tensor(s) for s in others]
        pattern = None if window is None else patterns.sliding_window(window)
        alone = _outputs(a, dtype, pattern)
        _assert_same(alone, _outputs(b + a, dtype, pattern), "after other sequences")
        _assert_same(alone, _outputs(a[::-1] + b, dtype, pattern), "reversed, before other sequences")
        _assert_same(alone, _outputs(a[split:] or a, dtype, pattern), "some of them alone")
    finally:
        lse_plan.CHUNK = old


def test_a_logaddexp_merge_would_make_a_row_depend_on_its_place_in_the_call(monkeypatch):
    """Broken variant: ``torch.logaddexp`` in the merge gives an element other bits in a vectorized block than in
    the loop's scalar tail (this CPU), so a query's merge depends on how many rows share its call."""
    def logaddexp_merge(o1, l1, o2, l2, safe=True):
        l = torch.logaddexp(l1, l2)
        w1, w2 = torch.exp(l1 - l).nan_to_num(0.0), torch.exp(l2 - l).nan_to_num(0.0)
        return w1[..., None] * o1 + w2[..., None] * o2.to(o1.dtype), l

    monkeypatch.setattr(lse_plan, "CHUNK", 64)
    group = Layout.group(300, [200, 150])
    pair = Layout.pack([group, group])
    g = torch.Generator().manual_seed(0)
    q = 3 * torch.randn(1, 4, pair.num_tokens, 16, generator=g)
    k, v = (3 * torch.randn(1, 1, pair.num_tokens, 16, generator=g) for _ in range(2))
    n = group.num_tokens

    def both():
        return (attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], group, backend="lse"),
                attention(q, k, v, pair, backend="lse")[:, :, :n])

    assert torch.equal(*both())
    monkeypatch.setattr(lse, "merge", logaddexp_merge)
    if torch.equal(*both()):
        pytest.skip("this CPU's logaddexp gives the same bits in and out of its vectorized blocks: nothing to break")
    assert not torch.equal(*both())
