"""A streamed chunk's attention: its queries against [kept K/V of its ancestors ; its own K/V].

Oracle: every root-to-leaf sequence of the whole layout (context + chunk) run alone through plain
causal attention (``_core_reference.reference_attention``), read at the chunk's rows. Both plans of
``plan_suffix`` -- ``lse`` (mask-free parts merged by log-sum-exp; CPU default) and ``sdpa`` --,
outputs and the gradients of q, of the chunk's k/v and of the kept context's k/v, float64.
"""

from __future__ import annotations

import pytest
import torch
from _core_reference import one_torch_thread, reference_attention  # noqa: F401  (autouse fixture)

from hypothesis import given, settings, strategies as st

from flexgroup import Layout, patterns as P, score_mods as S
from flexgroup.kernels import kept, lse_plan as kept_lse_plan

# context: a 40-token root and a 30-token turn below it; the chunk: a 600-token response under the turn
# (long enough to be cut into a chain of 256-token chunks), two siblings under the root, and one more
# level below the first sibling
PARENTS = [-1, 0, 1, 0, 0, 3]
LENGTHS = [40, 30, 600, 7, 19, 12]
N_CONTEXT = 70


def run(plan, q, k, v):
    Q = q.shape[2] - N_CONTEXT
    out = kept.attend_with_context(plan, q[:, :, N_CONTEXT:], k[:, :, N_CONTEXT:], v[:, :, N_CONTEXT:],
                                   [k[:, :, :40], k[:, :, 40:N_CONTEXT]], [v[:, :, :40], v[:, :, 40:N_CONTEXT]],
                                   scale=q.shape[-1] ** -0.5)
    assert out.shape[2] == Q
    return out


@pytest.mark.parametrize("pattern", [None, P.sliding_window(25), P.sliding_window(700)], ids=["causal", "window",
                                                                                                 "wide_window"])
@pytest.mark.parametrize("backend", ["lse", "sdpa"])
def test_a_chunk_attends_to_its_kept_context_as_each_sequence_alone_would(backend, pattern, monkeypatch):
    if backend == "sdpa":
        monkeypatch.setattr(kept.lse_ops, "available", lambda device_type: False)
    lay = Layout.tree(PARENTS, LENGTHS)
    plan = kept.plan_suffix(lay, N_CONTEXT, pattern, None, torch.device("cpu"))
    assert plan.backend == backend
    g = torch.Generator().manual_seed(0)
    L = lay.num_tokens
    q, k, v = (torch.randn(1, h, L, 16, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    w = torch.randn(1, 4, L - N_CONTEXT, 16, generator=g, dtype=torch.float64)
    out = run(plan, q, k, v)
    (out * w).sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    kk, vv = (x.repeat_interleave(2, 1) for x in (k, v))  # the reference reads one kv head per query head
    want = reference_attention(q, kk, vv, lay, pattern=pattern)[:, :, N_CONTEXT:]
    (want * w).sum().backward()
    assert float((out - want).detach().abs().max()) < 1e-12
    for got, x in zip(grads, (q, k, v)):
        assert float((got - x.grad).abs().max()) < 1e-12
    assert float(grads[1][:, :, :N_CONTEXT].abs().max()) > 0  # the kept context gets its gradient


def test_the_lse_plan_of_a_chunk_builds_no_mask_where_no_pattern_cuts_a_part():
    plan = kept.plan_suffix(Layout.tree(PARENTS, LENGTHS), N_CONTEXT, None, None, torch.device("cpu"))
    assert plan.backend == "lse" and all(p.mask is None for p in plan.data.parts)
    assert min(int(p.tokens.min()) for p in plan.data.parts) == 0  # query rows are the chunk's own


def test_a_score_mod_takes_the_sdpa_plan():
    plan = kept.plan_suffix(Layout.tree(PARENTS, LENGTHS), N_CONTEXT, None, S.softcap(30.0), torch.device("cpu"))
    assert plan.backend == "sdpa"


@pytest.mark.parametrize("chunk", [2, 4, 16, 64])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_trees_chunks_and_context_splits_equal_each_sequence_alone(chunk, data):
    """The lse plans of a streamed chunk on random trees: the first segments are the kept context, the rest the
    chunk's queries; grids of 2-16 tokens (cells cross the context's boundary), with and without a window."""
    from _core_reference import forests

    parents, lengths = data.draw(forests(7, 30))
    if len(parents) < 2:
        return
    first = data.draw(st.integers(1, len(parents) - 1))
    if any(p >= first for p in parents[:first]):
        return
    pattern = data.draw(st.sampled_from([None, P.sliding_window(9)]))
    lay = Layout.tree(parents, lengths)
    n_ctx = sum(lengths[:first])
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    L = lay.num_tokens
    q, k, v = (torch.randn(1, h, L, 8, generator=g, dtype=torch.float64) for h in (2, 1, 1))
    kept_lse_plan.CHUNK, old = chunk, kept_lse_plan.CHUNK
    try:
        plan = kept.plan_suffix(lay, n_ctx, pattern, None, torch.device("cpu"))
    finally:
        kept_lse_plan.CHUNK = old
    out = kept.attend_with_context(plan, q[:, :, n_ctx:], k[:, :, n_ctx:], v[:, :, n_ctx:], [k[:, :, :n_ctx]],
                                   [v[:, :, :n_ctx]], scale=0.3)
    want = reference_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), lay, pattern=pattern,
                               scale=0.3)[:, :, n_ctx:]
    assert float((out - want).abs().max()) < 1e-12
