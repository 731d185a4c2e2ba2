"""float64_by_layer: a float64 run of a float32 model without a float64 copy, one block's weights at a time.

Oracle: a float64 deep copy of the stock model run under the suite's KeepFloat64 (so even HF's norms
and softmaxes stay float64): the true float64 result. The layerwise run must equal it up to the one
rounding of each gradient to float32, and must keep no float64 weight for the backward outside the
block being run.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import VOCAB, KeepFloat64, make_tiny

from flexgroup.reference import layerwise
from flexgroup.models.zoo import build_model, unavailable
from flexgroup.verification.calibration import sequence_backward
from flexgroup.reference.layerwise import blocks, float64_by_layer

SEQ = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(0))
R, WEIGHT = 20, torch.tensor(0.7, dtype=torch.float64)


def run(model, ctx=None):
    """(logits [S, V], log-probs [R], {name: grad}) of SEQ alone, the loss WEIGHT * sum of its last R log-probs."""
    for p in model.parameters():
        p.grad = None
    with ctx or KeepFloat64():
        logits, lp = sequence_backward(model, SEQ, R, torch.ones(R, dtype=torch.bool), WEIGHT)
    return logits, lp, {k: p.grad for k, p in model.named_parameters()}


def worst_rel(grads, truth) -> float:
    return max(float((grads[k].double() - g).abs().max() / g.abs().max()) for k, g in truth.items())


@pytest.fixture(scope="module")
def llama():
    return make_tiny("llama")


@pytest.fixture(scope="module")
def truth(llama):
    return run(copy.deepcopy(llama).double())


def test_a_layerwise_run_of_a_float32_model_is_the_float64_truth(llama, truth):
    logits, lp, grads = run(llama, float64_by_layer(llama))
    assert logits.dtype == lp.dtype == torch.float64
    assert float((logits - truth[0]).abs().max()) < 1e-12 and float((lp - truth[1]).abs().max()) < 1e-12
    assert worst_rel(grads, truth[2]) < 2e-7  # each gradient rounded once to float32
    assert all(g.dtype == torch.float32 for g in grads.values())
    stock = run(llama, torch.enable_grad())  # the float32 run it calibrates is much further from the truth
    assert float((stock[0].double() - truth[0]).abs().max()) > 1e-8


def test_a_precision_request_that_lowers_to_float32_is_caught(llama, truth, monkeypatch):
    # broken variant: dtype arguments pass through, so HF's RMSNorm computes in float32 again
    monkeypatch.setattr(layerwise, "_up", lambda x: x.double() if isinstance(x, torch.Tensor)
                        and x.dtype == torch.float32 else x)
    logits = run(llama, float64_by_layer(llama))[0]
    assert float((logits - truth[0]).abs().max()) > 1e-12


def _saved_outside_blocks(model) -> list[torch.Tensor]:
    """The float64 tensors autograd keeps for the backward outside the checkpointed blocks."""
    kept = []

    def pack(t):
        if t.dtype == torch.float64:
            kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(model, float64_by_layer(model))
    return kept


def test_no_float64_weight_is_kept_for_the_backward_outside_the_block_being_run(llama, monkeypatch):
    shapes = {tuple(p.shape) for p in llama.parameters() if p.ndim == 2}
    assert not [t.shape for t in _saved_outside_blocks(llama) if tuple(t.shape) in shapes]
    monkeypatch.setattr(layerwise, "blocks", lambda model: [])  # broken variant: nothing checkpointed
    assert [t.shape for t in _saved_outside_blocks(llama) if tuple(t.shape) in shapes]


def test_the_blocks_are_the_decoder_layers_and_the_output_embedding_and_are_restored_on_error(llama):
    found = blocks(llama)
    assert found == [*llama.model.layers, llama.lm_head]
    with pytest.raises(RuntimeError, match="boom"), float64_by_layer(llama):
        assert all("forward" in b.__dict__ for b in found)
        raise RuntimeError("boom")
    assert not any("forward" in b.__dict__ for b in found) and torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("arch", ["qwen3_5_text", "bamba"])
def test_a_hybrid_with_a_recurrent_scan_runs_layerwise_at_the_float64_truth(arch):
    if unavailable(arch):
        pytest.skip(unavailable(arch))
    model = build_model(arch).float().eval()
    truth = run(copy.deepcopy(model).double())
    logits, _, grads = run(model, float64_by_layer(model))
    assert float((logits - truth[0]).abs().max()) < 1e-10
    assert worst_rel(grads, truth[2]) < 2e-7


def test_a_bfloat16_model_runs_from_its_own_weights_in_float64(llama):
    bf16 = copy.deepcopy(llama).to(torch.bfloat16)
    truth = run(copy.deepcopy(bf16).double())
    logits, _, grads = run(bf16, float64_by_layer(bf16))
    assert float((logits - truth[0]).abs().max()) < 1e-12
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
    assert worst_rel(grads, truth[2]) < 1e-2  # rounded once to bfloat16


def test_a_forward_set_on_the_instance_is_checkpointed_too_and_put_back(llama, truth):
    layer = llama.model.layers[0]
    calls = []

    def hooked(*args, **kwargs):  # like accelerate's hooks: module.forward replaced on the instance
        calls.append(1)
        return type(layer).forward(layer, *args, **kwargs)

    layer.forward = hooked
    try:
        logits, _, grads = run(llama, float64_by_layer(llama))
        assert layer.forward is hooked and len(calls) == 2  # the forward, then its recomputation in the backward
    finally:
        del layer.forward
    assert float((logits - truth[0]).abs().max()) < 1e-12 and worst_rel(grads, truth[2]) < 2e-7
