"""Models patched with the ``lse`` backend equal each sequence run alone through the stock model (issue 25).

Oracle: deep copies of the *unpatched* tiny models (stock sdpa; eager for Gemma 2), one call per
sequence; log-probs, logits and every parameter gradient compared in float64 and float32. Helpers are
the ones the sdpa-backend tests use (``test_grouped_equals_stock``, ``test_trees``), with ``backend="lse"``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.kernels import lse, lse_plan
from flexgroup.models.zoo import build_model, unavailable
from test_grouped_equals_stock import CASES, _grouped_vs_baseline
from test_trees import check_against_alone, distinct_prefixes, forests

# llama: GQA; mistral / qwen2: window 4, shorter than the prompts, so it crosses every branch point;
# gemma2: softcapping (a score_mod: the lse backend runs the sdpa plan for it)
ARCHS = ["llama", "mistral", "qwen2", "gemma2"]


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunk chains at 4 tokens: the tiny prompts take the chained own-part path too."""
    monkeypatch.setattr(lse_plan, "CHUNK", 4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_groups_equal_each_sequence_alone_through_the_stock_model(arch, dtype, tiny_model, hf_oracle, groups,
                                                                   precision_for, small_chunks):
    ctx, atol, rel = precision_for(dtype)
    model = tiny_model(arch, dtype).train()
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model, backend="lse")
    prompts, responses = groups(CASES["several_groups_in_one_row"], seed=3)
    _grouped_vs_baseline(model, stock, prompts, responses, ctx, atol, rel, hf_oracle)


@pytest.mark.parametrize("arch, dtype", [("llama", torch.float64), ("qwen2", torch.float64),
                                         ("llama", torch.float32)], ids=["llama-f64", "qwen2-f64", "llama-f32"])
def test_trajectory_trees_with_mid_turn_branches_prefixes_and_duplicates(arch, dtype, tiny_model, hf_oracle,
                                                                          precision_for):
    ctx, atol, rel = precision_for(dtype)
    model = tiny_model(arch, dtype).train()
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model, backend="lse")
    ran: list[int] = []

    @settings(max_examples=6, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(forests())
    def prop(data):
        seqs, masks = data
        ran.append(len(seqs))
        for m in (stock, model):
            m.zero_grad(set_to_none=True)
        batch, _ = check_against_alone(model, stock, seqs, masks, ctx, atol, rel, hf_oracle)
        assert batch.num_tokens == distinct_prefixes(seqs)

    prop()
    assert max(ran) >= 4, ran


@pytest.mark.skipif(bool(unavailable("qwen3_5_text")), reason=str(unavailable("qwen3_5_text")))
def test_a_hybrids_attention_layers_through_lse(hf_oracle, groups, precision_for):
    ctx, atol, rel = precision_for(torch.float64)
    model = build_model("qwen3_5_text", dtype=torch.float64)
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model, backend="lse")
    prompts, responses = groups([(67, [1, 2, 3, 70]), (2, [5, 1])], seed=1, vocab=model.config.vocab_size)
    batch = GroupedBatch.from_groups(prompts, responses)
    adv = torch.linspace(-1.0, 1.5, 6, dtype=torch.float64)
    with ctx:
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        sum(a * lp[i].sum() for i, a in enumerate(adv)).backward()
        _, ref = hf_oracle.run(stock, prompts, responses)
        hf_oracle.loss(ref, adv).backward()
    err = max((lp[i, : len(r)] - r).abs().max().item() for i, r in enumerate(ref))
    assert err <= atol, err
    hf_oracle.assert_grads_close(hf_oracle.grads(model), hf_oracle.grads(stock), rel)


def test_a_merge_without_the_lse_weights_is_caught_at_model_level(tiny_model, hf_oracle, groups, precision_for,
                                                                  monkeypatch, small_chunks):
    def unweighted(o1, l1, o2, l2, safe=True):
        return (o1 + o2.to(o1.dtype)) / 2, torch.logaddexp(l1, l2)

    monkeypatch.setattr(lse, "merge", unweighted)
    ctx, atol, rel = precision_for(torch.float64)
    model = tiny_model("llama", torch.float64).train()
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model, backend="lse")
    prompts, responses = groups(CASES["one_group"], seed=3)
    with pytest.raises(AssertionError):
        _grouped_vs_baseline(model, stock, prompts, responses, ctx, atol, rel, hf_oracle)
