"""The ``lse`` backend against each sequence run alone with plain causal attention (issue 25).

Oracle: ``_core_reference.reference_attention`` -- every root-to-leaf sequence rebuilt from parent
pointers and attended alone with an explicit float64 softmax; gradients by autograd through it.
The backend cuts a row into mask-free fused-kernel parts merged by log-sum-exp; these tests check
the output and the gradients of q, k and v in float64 and float32, and that a merge without the LSE
weights is caught.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from _core_reference import PATTERNS, layouts, one_torch_thread, reference_attention  # noqa: F401
from flexgroup import Layout, patterns as P, score_mods as S
from flexgroup.kernels import BACKENDS, attention, lse, lse_ops, lse_plan, prepare, resolve

TOL = {torch.float64: 1e-12, torch.float32: 2e-5}

# name -> layout: a group, equal siblings, a tree with mid-turn branches (a segment continued by two
# branches that are each continued again), a pack of groups and a tree beside a lone root, and a chain
# (one path: its cells' tokens are contiguous rows, read as slices, with segment boundaries inside cells)
LAYOUTS = {
    "chain": Layout.tree([-1, 0, 1], [12, 23, 9]),
    "group": Layout.group(11, [3, 7, 1, 5]),
    "equal_siblings": Layout.group(9, [4, 4, 4]),
    "mid_turn_tree": Layout.tree([-1, 0, 1, 1, 2, 2, 3, 0], [6, 4, 3, 5, 2, 6, 3, 7]),
    "pack": Layout.pack([Layout.group(8, [2, 5]), Layout.group(8, [2, 5]), Layout.tree([-1, 0, 0], [5, 3, 4]),
                         Layout.tree([-1], [13])]),
}


def qkv(L, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, L, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for h in (hq, hkv, hkv)]


def outputs_and_grads(fn, q, k, v, seed=1):
    out = fn(q, k, v)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    return (out, *torch.autograd.grad((out * w).sum(), (q, k, v)))


def max_errors(lay, *, pattern=None, scale=None, hq=4, hkv=2, dtype=torch.float64, seed=0):
    """Max |difference| of (out, dq, dk, dv) between backend 'lse' and each sequence alone."""
    q, k, v = qkv(lay.num_tokens, hq, hkv, dtype=dtype, seed=seed)
    got = outputs_and_grads(lambda *x: attention(*x, lay, pattern=pattern, scale=scale, backend="lse"), q, k, v)
    ref = outputs_and_grads(lambda *x: reference_attention(*x, lay, pattern=pattern, scale=scale), q, k, v)
    return [(a.double() - b.double()).abs().max().item() for a, b in zip(got, ref)]


@pytest.fixture
def small_chunks(monkeypatch):
    """A grid (and chains) of 3 tokens: short test rows are cut into many cells, merged by their LSEs."""
    monkeypatch.setattr(lse_plan, "CHUNK", 3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_output_and_every_gradient_equal_each_sequence_alone(name, dtype):
    errs = max_errors(LAYOUTS[name], dtype=dtype)
    assert max(errs) <= TOL[dtype], errs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_keys_cut_on_a_small_grid_stay_exact(name, dtype, small_chunks):
    assert any(not p.own for p in prepare(LAYOUTS[name], None, None, "cpu", BACKENDS["lse"]).data.parts)
    errs = max_errors(LAYOUTS[name], dtype=dtype)
    assert max(errs) <= TOL[dtype], errs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_window_on_a_small_grid_stays_exact(name, dtype, small_chunks):
    assert any(p.mask is not None for p in prepare(LAYOUTS[name], P.sliding_window(5), None, "cpu",
                                                   BACKENDS["lse"]).data.parts)
    errs = max_errors(LAYOUTS[name], dtype=dtype, pattern=P.sliding_window(5))
    assert max(errs) <= TOL[dtype], errs


@pytest.mark.parametrize("hq, hkv", [(3, 3), (4, 1), (8, 2)])
def test_grouped_query_attention_and_a_custom_scale(hq, hkv):
    errs = max_errors(LAYOUTS["mid_turn_tree"], hq=hq, hkv=hkv, scale=0.37)
    assert max(errs) <= TOL[torch.float64], errs


def test_a_group_on_a_grid_of_16_one_causal_call_then_one_unmasked_call_per_cell_against_the_path_before_it(
        monkeypatch):
    monkeypatch.setattr(lse_plan, "CHUNK", 16)
    lay = Layout.group(40, [3, 7, 1, 5])                 # responses at virtual positions 40-46
    parts = prepare(lay, None, None, "cpu", BACKENDS["lse"]).data.parts
    own, before = parts[0], parts[1:]
    # cells 0 and 1 of the prompt, and cell 2 (prompt tokens 32-39, then a response) once per response
    assert (own.G, own.n, own.causal, own.mask, own.own) == (6, 16, True, None, True)
    assert sorted(own.tokens.tolist()) == list(range(lay.num_tokens))          # every token written once
    # cell 1's queries against cell 0; cell 2's (the prompt's last 8 tokens and every response) against cells 0-1
    assert [(p.G, p.n, p.m, p.causal, p.own, p.mask) for p in before] == [(1, 16, 16, False, False, None),
                                                                          (1, 24, 32, False, False, None)]
    assert [p.k_start for p in before] == [0, 0]          # the keys: slices of the packed row, no gather
    assert [p.q_start for p in before] == [16, 32]


def test_a_window_masks_only_the_nodes_it_cuts():
    # window 6: the first group's paths (16, 14, 12 tokens) are cut; the second group's (3, 4) are not
    lay = Layout.pack([Layout.group(10, [6, 4, 2]), Layout.group(2, [1, 2])])
    win = P.sliding_window(6)
    parts = prepare(lay, win, None, "cpu", BACKENDS["lse"]).data.parts
    causal = [p for p in parts if p.own and p.mask is None]
    cut = [p for p in parts if p.own and p.mask is not None]
    assert len(causal) == 1 and causal[0].causal and sorted(causal[0].tokens.tolist()) == list(range(22, 27))
    assert len(cut) == 1 and not cut[0].causal and sorted(cut[0].tokens.tolist()) == list(range(22))
    errs = max_errors(lay, pattern=win)
    assert max(errs) <= TOL[torch.float64], errs


def test_a_pattern_that_allows_every_pair_builds_no_mask():
    lay = LAYOUTS["mid_turn_tree"]
    parts = prepare(lay, P.sliding_window(1000), None, "cpu", BACKENDS["lse"]).data.parts
    assert all(p.mask is None for p in parts)


@pytest.mark.parametrize("chunk", [3, 256])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@settings(max_examples=25, deadline=None)
@given(layouts(max_segments=8, max_len=24, max_tokens=80), st.sampled_from(sorted(PATTERNS)),
       st.sampled_from([(4, 2), (2, 2), (4, 1)]), st.integers(0, 2**16))
def test_random_layouts_and_patterns_equal_each_sequence_alone(chunk, dtype, lay, name, heads, seed):
    lse_plan.CHUNK, old = chunk, lse_plan.CHUNK
    try:
        errs = max_errors(lay, pattern=PATTERNS[name][0], hq=heads[0], hkv=heads[1], dtype=dtype, seed=seed)
    finally:
        lse_plan.CHUNK = old
    assert max(errs) <= TOL[dtype], (name, errs)


def test_rows_whose_pattern_allows_no_key_return_zero_with_zero_gradients():
    lay = LAYOUTS["group"]
    q, k, v = qkv(lay.num_tokens)
    out, dq, dk, dv = outputs_and_grads(lambda *x: attention(*x, lay, pattern=P.prefix_tokens(0), backend="lse"),
                                        q, k, v)
    assert out.abs().max() == 0 and all(g.abs().max() == 0 for g in (dq, dk, dv))


def test_bfloat16_is_as_close_to_float64_as_the_stock_kernel_alone():
    lay = LAYOUTS["mid_turn_tree"]
    q, k, v = qkv(lay.num_tokens)
    truth = outputs_and_grads(lambda *x: reference_attention(*x, lay), q, k, v)
    qb, kb, vb = (x.detach().bfloat16().requires_grad_() for x in (q, k, v))
    got = outputs_and_grads(lambda *x: attention(*x, lay, backend="lse"), qb, kb, vb)
    stock = outputs_and_grads(lambda *x: attention(*x, lay, backend="sdpa"), qb, kb, vb)
    for g, s, t in zip(got, stock, truth):
        assert g.dtype == torch.bfloat16
        err, stock_err = ((x.double() - t).abs().max().item() for x in (g, s))
        assert err <= 2 * stock_err + 1e-2, (err, stock_err)


def test_the_explicit_score_fallback_for_parts_is_exact(monkeypatch):
    # a device without a fused kernel: every part runs lse_ops.math_forward / math_backward
    monkeypatch.setattr(lse_ops, "_CPU", "no_such_kernel")
    monkeypatch.setattr(lse_ops, "available", lambda device_type: True)
    for name, pattern in (("pack", None), ("mid_turn_tree", P.sliding_window(3))):
        errs = max_errors(LAYOUTS[name], pattern=pattern)
        assert max(errs) <= TOL[torch.float64], (name, errs)


def test_a_cpu_op_without_gqa_or_masks_repeats_kv_heads_and_masks_explicitly(monkeypatch):
    # what an older torch whose fused CPU op fails the probes gets
    monkeypatch.setattr(lse_ops, "_CPU_FEATURES", {"gqa": False, "mask": False})
    errs = max_errors(LAYOUTS["mid_turn_tree"], pattern=P.sliding_window(3), hq=4, hkv=1)
    assert max(errs) <= TOL[torch.float64], errs


def test_a_merge_without_the_lse_weights_is_caught(monkeypatch, small_chunks):
    # the deliberately broken variant: each part's output averaged, not weighted by its softmax mass
    def unweighted(o1, l1, o2, l2, safe=True):
        return (o1 + o2.to(o1.dtype)) / 2, torch.logaddexp(l1, l2)

    monkeypatch.setattr(lse, "merge", unweighted)
    errs = max_errors(LAYOUTS["group"])
    assert errs[0] > 1e-2 and max(errs[1:]) > 1e-2, errs


def test_score_mods_and_missing_kernels_fall_back_to_the_sdpa_plan(monkeypatch):
    lay = LAYOUTS["group"]
    assert prepare(lay, None, S.softcap(5.0), "cpu", BACKENDS["lse"]).backend == "sdpa"
    q, k, v = qkv(lay.num_tokens)
    got = attention(q, k, v, lay, score_mod=S.softcap(5.0), backend="lse")
    torch.testing.assert_close(got, reference_attention(q, k, v, lay, score_mod=S.softcap(5.0)), atol=1e-12, rtol=0)
    monkeypatch.setattr(lse_ops, "_CPU", "no_such_kernel")     # torch without the fused CPU op
    assert not lse_ops.available("cpu")
    assert BACKENDS["lse"].prepare(lay, None, None, torch.device("cpu")).backend == "sdpa"


def test_auto_picks_lse_on_cpu_and_sdpa_stays_selectable():
    assert resolve("auto", "cpu", needs_grad=True).name == "lse"
    assert resolve("sdpa", "cpu", needs_grad=True).name == "sdpa"
