"""Acceptance tests for flexgroup.patterns: semantics on positions, block bounds, score_mods."""

from __future__ import annotations

import pytest
import torch

from flexgroup import patterns as P, score_mods as S

from _core_reference import one_torch_thread  # noqa: F401  (autouse fixture)
from _core_reference import PATTERNS, slopes


def allowed_keys(pattern, q: int) -> list[int]:
    """Causal keys kv <= q that ``pattern`` allows for query position q."""
    kv = torch.arange(q + 1)
    return kv[pattern(torch.tensor(q), kv)].tolist()


# ------------------------------------------------------------------ semantics


def test_sliding_window_keeps_the_last_w_positions_including_itself():
    assert allowed_keys(P.sliding_window(3), 10) == [8, 9, 10]
    assert allowed_keys(P.sliding_window(1), 4) == [4]
    assert allowed_keys(P.sliding_window(100), 4) == [0, 1, 2, 3, 4]


def test_chunked_keeps_the_query_chunk_only():
    assert allowed_keys(P.chunked(4), 5) == [4, 5]
    assert allowed_keys(P.chunked(4), 3) == [0, 1, 2, 3]
    assert allowed_keys(P.chunked(1), 7) == [7]


def test_sinks_keep_the_first_n_positions_and_a_window():
    assert allowed_keys(P.sinks(2, 3), 10) == [0, 1, 8, 9, 10]
    assert allowed_keys(P.sinks(2, 3), 2) == [0, 1, 2]
    assert allowed_keys(P.prefix_tokens(0), 5) == []


def test_strided_keeps_every_stride_th_key_plus_an_optional_local_window():
    assert allowed_keys(P.strided(3), 10) == [1, 4, 7, 10]
    assert allowed_keys(P.strided(4, local=2), 10) == [2, 6, 9, 10]
    assert allowed_keys(P.strided(1), 3) == [0, 1, 2, 3]


def test_block_sparse_looks_up_blocks_and_reuses_the_last_row_and_column():
    allowed = torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)
    p = P.block_sparse(2, allowed)
    assert allowed_keys(p, 1) == [0, 1]
    assert allowed_keys(p, 3) == [2, 3]
    assert allowed_keys(p, 9) == [2, 3, 4, 5, 6, 7, 8, 9]  # rows and columns past the table clamp


def test_block_sparse_copies_its_table():
    allowed = torch.tensor([[True]])
    p = P.block_sparse(4, allowed)
    allowed[0, 0] = False
    assert allowed_keys(p, 2) == [0, 1, 2]


def test_patterns_compose_with_and_or_and_plain_callables():
    w, c = P.sliding_window(3), P.chunked(4)
    assert allowed_keys(w & c, 5) == [4, 5]
    assert allowed_keys(w | c, 5) == [3, 4, 5]
    evens = lambda q, kv: kv % 2 == 0  # noqa: E731
    assert allowed_keys(w & evens, 6) == [4, 6]
    assert allowed_keys(P.any_of(evens, P.prefix_tokens(1)), 3) == [0, 2]
    assert allowed_keys(P.all_of(P.from_callable(evens), w, c), 6) == [4, 6]
    assert "sliding_window_3" in (w & c).__name__ and "chunked_4" in (w | c).__name__


@pytest.mark.parametrize("call, exc, needle", [
    (lambda: P.sliding_window(0), ValueError, "sliding_window(0)"),
    (lambda: P.sliding_window(2.0), ValueError, "sliding_window(2.0)"),
    (lambda: P.sliding_window(True), ValueError, "sliding_window(True)"),
    (lambda: P.chunked(0), ValueError, "chunked(0)"),
    (lambda: P.strided(0), ValueError, "strided(0)"),
    (lambda: P.prefix_tokens(-1), ValueError, "prefix_tokens(-1)"),
    (lambda: P.sinks(-1, 2), ValueError, "prefix_tokens(-1)"),
    (lambda: P.block_sparse(0, torch.ones(1, 1, dtype=torch.bool)), ValueError, "block_sparse(0"),
    (lambda: P.block_sparse(2, torch.ones(2, 2)), ValueError, "2-D BoolTensor"),
    (lambda: P.block_sparse(2, torch.ones(2, dtype=torch.bool)), ValueError, "2-D BoolTensor"),
    (lambda: P.block_sparse(2, torch.ones(0, 3, dtype=torch.bool)), ValueError, "shape (0, 3)"),
    (lambda: P.all_of(), ValueError, "at least one"),
    (lambda: P.any_of(), ValueError, "at least one"),
    (lambda: P.all_of(P.chunked(2), 3), TypeError, "got int"),
    (lambda: S.softcap(0), ValueError, "softcap(0)"),
    (lambda: S.softcap(-1.5), ValueError, "softcap(-1.5)"),
    (lambda: S.alibi([]), ValueError, "shape (0,)"),
    (lambda: S.alibi([[1.0]]), ValueError, "shape (1, 1)"),
])
def test_bad_pattern_and_score_mod_arguments_raise_naming_the_value(call, exc, needle):
    with pytest.raises(exc) as e:
        call()
    assert needle in str(e.value)


# ------------------------------------------------------------------ block bounds


def brute_bounds(pattern, rects):
    anys, alls = [], []
    for q_lo, q_hi, kv_lo, kv_hi in rects.tolist():
        qs, ks = torch.arange(q_lo, q_hi + 1)[:, None], torch.arange(kv_lo, kv_hi + 1)[None, :]
        causal = ks <= qs
        ok = pattern(qs, ks) & causal
        anys.append(bool(ok.any()))
        alls.append(bool(ok[causal].all()))
    return torch.tensor(anys), torch.tensor(alls)


def random_rects(n: int, seed: int) -> torch.Tensor:
    """[n, 4] rectangles (q_lo, q_hi, kv_lo, kv_hi) of positions with at least one causal pair."""
    g = torch.Generator().manual_seed(seed)
    q_lo = torch.randint(0, 40, (n,), generator=g)
    q_hi = q_lo + torch.randint(0, 17, (n,), generator=g)
    kv_lo = torch.randint(0, 40, (n,), generator=g)
    kv_lo = torch.minimum(kv_lo, q_hi)  # kv_lo <= q_hi: some kv <= q exists
    kv_hi = kv_lo + torch.randint(0, 17, (n,), generator=g)
    return torch.stack([q_lo, q_hi, kv_lo, kv_hi], 1)


@pytest.mark.parametrize("name", [n for n in PATTERNS if n != "none"])
def test_block_bounds_never_miss_an_allowed_pair_nor_call_a_forbidden_pair_allowed(name):
    pattern, exact = PATTERNS[name]
    pat = P.from_callable(pattern)
    rects = random_rects(600, seed=len(name))
    any_, all_ = pat.bounds(*rects.unbind(1))
    want_any, want_all = brute_bounds(pattern, rects)
    assert bool((any_ | ~want_any).all()), "an allowed pair was reported as absent"
    assert bool((~all_ | want_all).all()), "a forbidden pair was reported as allowed"
    if exact:  # built-in patterns (and or-compositions of them) are exact on "any"
        assert torch.equal(any_, want_any)


@pytest.mark.parametrize("shape, block", [((1, 1), 2), ((1, 5), 1), ((5, 1), 2), ((3, 7), 3), ((8, 2), 1)])
def test_block_sparse_bounds_are_exact_for_any_table_shape(shape, block):
    g = torch.Generator().manual_seed(shape[0] * 10 + shape[1])
    for trial in range(3):
        allowed = torch.rand(shape, generator=g) > 0.5
        p = P.block_sparse(block, allowed)
        rects = random_rects(300, seed=trial)
        any_, all_ = p.bounds(*rects.unbind(1))
        want_any, want_all = brute_bounds(p, rects)
        assert torch.equal(any_, want_any)
        assert torch.equal(all_, want_all)


def test_user_callables_get_conservative_bounds():
    any_, all_ = P.from_callable(lambda q, kv: q == kv).bounds(*random_rects(5, 0).unbind(1))
    assert bool(any_.all()) and not bool(all_.any())


# ------------------------------------------------------------------ score_mods


def _args(n=3, h=2):
    s = torch.randn(1, h, n, n, dtype=torch.float64) * 20
    pos = torch.arange(n)
    return s, torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(h).view(1, h, 1, 1), pos.view(n, 1), pos.view(1, n)


def test_softcap_is_cap_times_tanh_of_score_over_cap():
    s, b, h, qp, kp = _args()
    out = S.softcap(5.0)(s, b, h, qp, kp)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, 5.0 * torch.tanh(s / 5.0), rtol=0, atol=1e-12)
    assert float(out.abs().max()) < 5.0


def test_alibi_adds_slope_times_virtual_distance_per_head():
    s, b, h, qp, kp = _args(n=4, h=2)
    sl = slopes(2)
    out = S.alibi(sl)(s, b, h, qp, kp)
    for head in range(2):
        for i in range(4):
            for j in range(4):
                want = s[0, head, i, j] + sl[head].double() * (j - i)
                assert float(out[0, head, i, j] - want) == pytest.approx(0.0, abs=1e-6)


def test_user_score_mod_is_wrapped_and_score_mods_move_to_a_device():
    fn = lambda s, b, h, q, kv: s + q - kv  # noqa: E731
    sm = S.score_mod(fn)
    assert S.score_mod(sm) is sm
    s, b, h, qp, kp = _args()
    torch.testing.assert_close(sm(s, b, h, qp, kp), s + qp - kp)
    cap = S.softcap(2.0)
    moved = cap.to("cpu")
    assert moved is cap.to("cpu") and moved.cap.device.type == "cpu"
    torch.testing.assert_close(moved(s, b, h, qp, kp), cap(s, b, h, qp, kp))
