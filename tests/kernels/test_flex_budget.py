"""The compiled flex path's compile budget and its never-crash rule (kernels layer).

Past dynamo's recompile limit the flex backend must switch to the exact sdpa backend with one warning
(never eager flex, never an exception mid-training); with the CUDA compile configuration the number of
graphs must stop growing after the first lengths. Each test compiles a few times (seconds each).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.attention.flex_attention

import flexgroup
from flexgroup import Layout
from flexgroup.kernels import flex

from _core_reference import reference_attention


@pytest.fixture
def fresh_flex(monkeypatch):
    """Process-wide compiled-kernel state emptied for the test and restored after it."""
    monkeypatch.setattr(flex, "_FALLBACK", {})
    monkeypatch.setattr(flex, "_COMPILED_FLEX", {})
    monkeypatch.setattr(flex, "_GRAPH_CODES", {})
    monkeypatch.setattr(flex, "_CPU_KERNEL_OK", {})
    from flexgroup import kernels

    monkeypatch.setattr(kernels, "_PLANS", type(kernels._PLANS)())


def qkv(lay: Layout, seed: int, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, lay.num_tokens, 16, generator=g).requires_grad_(grad) for h in (4, 2, 2)]


@pytest.mark.compiled
@pytest.mark.slow
def test_past_the_recompile_limit_flex_warns_once_and_continues_exactly_on_sdpa(fresh_flex):
    limit = "recompile_limit" if "recompile_limit" in torch._dynamo.config._config else "cache_size_limit"
    outs = []
    with torch.no_grad(), torch._dynamo.config.patch(**{limit: 1}), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (100, 300, 500, 700):  # CPU kernels are static: each padded length is a new graph
            lay = Layout.group(n, [5, 7])
            q, k, v = qkv(lay, n)
            try:
                outs.append((flexgroup.attention(q, k, v, lay, backend="flex"), reference_attention(q, k, v, lay)))
            except NotImplementedError as e:  # exact or loud: this torch's CPU kernel was refused
                pytest.skip(f"compiled CPU flex refused by the self-check: {e}")
    why = [str(w.message) for w in caught if "recompile limit" in str(w.message)]
    assert len(why) == 1, why  # one warning for the whole process, not one per call
    assert f"torch._dynamo.config.{limit}" in why[0] and "'sdpa'" in why[0] and "graphs" in why[0]
    assert flex._FALLBACK  # the rest of the process runs sdpa
    for got, want in outs:
        assert (got - want).abs().max() <= 1e-5


def test_after_the_fallback_training_through_flex_still_gets_exact_gradients(fresh_flex):
    flex._FALLBACK["why"] = "forced by the test"
    lay = Layout.tree([-1, 0, 0, 1], [40, 9, 6, 5])
    q, k, v = qkv(lay, 1, grad=True)
    with flex.cuda_profile_on_cpu():
        out = flexgroup.attention(q, k, v, lay, backend="flex")
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(reference_attention(q, k, v, lay).square().sum(), (q, k, v))
    assert not flex.compiled_graphs()  # nothing was compiled: sdpa ran
    for g, w in zip(grads, want):
        assert (g - w).abs().max() <= 1e-5


@pytest.mark.compiled
@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch.nn.attention.flex_attention, "AuxRequest"),
                    reason="the compile budget is measured on torch 2.13 (benchmarks/README.md); on torchs before "
                           "flex_attention's AuxRequest (2.9) dynamo built one graph per length here (5 for 5), and "
                           "past the limit the backend falls back to sdpa instead of crashing")
def test_with_the_cuda_configuration_the_graph_count_stops_growing_with_more_steps(fresh_flex):
    # the CUDA setting (automatic dynamic, lengths marked dynamic up front), counted on CPU with aot_eager
    counts = []
    with flex.cuda_profile_on_cpu():
        for step, (p, rs) in enumerate([(300, [40, 90]), (520, [7, 300, 64]), (900, [130, 5]),
                                        (1500, [31, 77, 200, 9]), (350, [500])]):
            lay = Layout.group(p, rs)
            q, k, v = qkv(lay, step, grad=True)
            out = flexgroup.attention(q, k, v, lay, backend="flex", pattern=flexgroup.patterns.sliding_window(256))
            out.sum().backward()
            counts.append(sum(flex.compiled_graphs().values()))
            if step == 1:
                want = reference_attention(q.detach(), k.detach(), v.detach(), lay,
                                           pattern=flexgroup.patterns.sliding_window(256))
                assert (out.detach() - want).abs().max() <= 1e-5
    assert not flex._FALLBACK
    assert counts[-1] == counts[1] <= 2, counts  # 5 lengths from 3 to 13 blocks: no graph after the 2nd
