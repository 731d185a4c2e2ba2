"""Grouped forwards under ``torch.inference_mode()`` (what serving and evaluation code uses): exact against each
sequence alone through the stock, unpatched model (float64), for a plain forward, needed-only logits,
``flexgroup.score`` and ``stream_logprobs``; and a scoring pass under inference mode leaves no inference tensor
in any cache (layout tensors, kernel plans, a batch's indices, pattern and score_mod constants), so training on
the same layout afterwards still matches the stock model's log-probs and every parameter gradient."""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch

F64 = torch.float64
SIZES = [(11, [5, 1, 4])]


def _reference(hf_oracle, stock, prompts, responses):
    """[N, max R] log-probs of each [P; R_i] alone through the stock model, under inference mode."""
    with torch.inference_mode():
        _, lps = hf_oracle.run(stock, prompts, responses)
    out = torch.zeros(len(lps), max(len(x) for x in lps), dtype=F64)
    for i, lp in enumerate(lps):
        out[i, :len(lp)] = lp
    return out


def _clear_process_caches():
    """So that this test, not an earlier one, builds the process-wide caches (under inference mode)."""
    from flexgroup import kernels
    from flexgroup.layout import masks
    from flexgroup.patches import _interface

    kernels._PLANS.clear()
    masks._BLOCK_MASKS.clear()
    _interface.window_pattern.cache_clear()
    _interface.softcap_mod.cache_clear()


@pytest.mark.parametrize("arch", ["llama", "gemma2"])   # gemma2: windows and softcapping (pattern, score_mod)
@pytest.mark.parametrize("backend", ["lse", "sdpa"])
def test_every_grouped_read_under_inference_mode_equals_each_sequence_alone(arch, backend, tiny_model, hf_oracle,
                                                                          groups, precision_for):
    ctx, atol, _ = precision_for(F64)
    prompts, responses = groups(SIZES)
    with ctx:
        stock = tiny_model(arch, F64)
        ref = _reference(hf_oracle, stock, prompts, responses)
        model = flexgroup.patch(hf_oracle.stock_copy(stock), backend=backend)
        seqs = [torch.cat([p, r]) for p, rs in zip(prompts, responses) for r in rs]
        with torch.inference_mode():
            batch = GroupedBatch.from_groups(prompts, responses)
            plain = batch.logprobs(model(**batch.model_inputs()).logits)
            needed = batch.logprobs(model(**batch.model_inputs(needed_logits_only=True)).logits)
            scored = flexgroup.score(model, prompts, responses).logprobs
            streamed = flexgroup.stream_logprobs(model, seqs, budget=128)
        assert plain.is_inference()
    P = len(prompts[0])
    for i, r in enumerate(responses[0]):
        for got in (plain[i, :len(r)], needed[i, :len(r)], scored[i], streamed[i, P:P + len(r)]):
            assert (got - ref[i, :len(r)]).abs().max() <= atol


@pytest.mark.parametrize("backend", ["lse", "sdpa"])
def test_training_after_an_inference_mode_pass_equals_each_sequence_alone(backend, tiny_model, hf_oracle, groups,
                                                                         precision_for):
    """Scoring under inference mode first (it builds the layout's tensors, the kernel plans kept in the LRU, the
    window pattern and the softcap score_mod), then a training step on the same batch and on a batch packed under
    inference mode: log-probs and every parameter gradient equal the stock model's, each sequence alone."""
    ctx, atol, rel = precision_for(F64)
    prompts, responses = groups(SIZES, seed=1)
    weights = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    _clear_process_caches()
    with ctx:
        stock = tiny_model("gemma2", F64)
        model = flexgroup.patch(hf_oracle.stock_copy(stock), backend=backend)
        batch = GroupedBatch.from_groups(prompts, responses)
        with torch.inference_mode():
            batch.logprobs(model(**batch.model_inputs()).logits)
            packed_in_inference = GroupedBatch.from_groups(prompts, responses)
        _, lps = hf_oracle.run(stock, prompts, responses)
        hf_oracle.loss(lps, weights).backward()
        ref_grads = hf_oracle.grads(stock)
        for b in (batch, packed_in_inference):
            model.zero_grad(set_to_none=True)
            lp = b.logprobs(model(**b.model_inputs()).logits)
            (lp * weights[:, None]).sum().backward()
            for i, ref in enumerate(lps):
                assert (lp[i, :len(ref)] - ref.detach()).abs().max() <= atol
            hf_oracle.assert_grads_close(hf_oracle.grads(model), ref_grads, rel)


def test_the_comparison_catches_attention_over_the_packed_row(tiny_model, hf_oracle, groups, precision_for,
                                                             causal_over_packed_row):
    ctx, atol, _ = precision_for(F64)
    prompts, responses = groups(SIZES)
    with ctx:
        stock = tiny_model("llama", F64)
        ref = _reference(hf_oracle, stock, prompts, responses)
        model = flexgroup.patch(hf_oracle.stock_copy(stock))
        with torch.inference_mode():
            batch = GroupedBatch.from_groups(prompts, responses)
            lp = batch.logprobs(model(**batch.model_inputs()).logits)
    assert (lp - ref).abs().max() > 1e-3


def test_position_ids_edited_in_place_under_inference_mode_are_refused(tiny_model, groups):
    """Inference tensors keep no version counter: the edit is caught by value instead."""
    prompts, responses = groups(SIZES)
    model = flexgroup.patch(tiny_model("llama"))
    batch = GroupedBatch.from_groups(prompts, responses)
    with torch.inference_mode():
        inputs = batch.model_inputs()
        inputs["position_ids"] += 1
        with pytest.raises(ValueError, match="modified in place"):
            model(**inputs)


def test_stream_backward_under_inference_mode_names_it(tiny_model, groups):
    prompts, responses = groups(SIZES)
    model = flexgroup.patch(tiny_model("llama"))
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"torch.inference_mode\(\).*stream_logprobs"):
        flexgroup.stream_backward(model, [torch.cat([prompts[0], responses[0][0]])], lambda lp, i: lp.sum(), budget=128)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_verify_called_under_no_grad_or_inference_mode_runs_its_own_backward(mode, tiny_model):
    """verify compares gradients itself: the caller's mode must not turn it into a false "no" (no gradient) or a
    crash; the report equals the one made with gradients enabled."""
    model = tiny_model("llama")
    batch = GroupedBatch.from_groups(*[[x] for x in _groups_of(SIZES)])
    plain = flexgroup.verify(model, batch, calibration="none")
    with mode():
        inside = flexgroup.verify(model, batch, calibration="none")
    assert plain.ok and inside.ok, inside.table()
    assert [(d.max_abs, d.max_rel) for d in inside.differences] == [(d.max_abs, d.max_rel) for d in plain.differences]


def test_verify_under_inference_mode_still_catches_attention_over_the_packed_row(tiny_model, causal_over_packed_row):
    batch, model = GroupedBatch.from_groups(*[[x] for x in _groups_of(SIZES)]), tiny_model("llama")
    with torch.inference_mode():
        report = flexgroup.verify(model, batch, calibration="none")
    assert not report.ok and report["grads"].max_rel > 1e-3


def test_verify_refuses_a_model_loaded_under_inference_mode(tiny_model):
    with torch.inference_mode():
        model = tiny_model("llama")
    batch = GroupedBatch.from_groups(*[[x] for x in _groups_of(SIZES)])
    with pytest.raises(ValueError, match=r"inference tensor .*torch.inference_mode\(\).*outside inference mode"):
        flexgroup.verify(model, batch, calibration="none")


def _groups_of(sizes):
    g = torch.Generator().manual_seed(5)
    (p, rs), = sizes
    return torch.randint(1, 61, (p,), generator=g), [torch.randint(1, 61, (n,), generator=g) for n in rs]
