"""Entry points refuse what they cannot compute, up front and by name, and accept what is only spelled differently:

- a model on the meta device (shapes, no data): ``stream_logprobs`` / ``stream_backward`` / ``score`` / ``verify``
  refuse before any forward, naming the device, the tensor and the fix -- which, followed, gives each sequence
  alone's log-probs;
- ``temperature=torch.tensor(2)`` (an integer tensor) is the temperature 2 everywhere (exact against each sequence
  alone at temperature 2); bool, complex, non-positive or many-element tensors are refused naming the problem;
- streaming a model with length-dependent RoPE scaling (``rope_type="dynamic"``) past its threshold names the
  scaling and its config field (``rope_parameters`` / ``rope_scaling``), not only ``max_position_embeddings``;
  within it, streaming equals each sequence alone.

Oracle: each sequence alone through a deep copy of the unpatched model, float64 (norms kept in float64).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.reference.oracle import logprobs_alone
from flexgroup.stream import stream_forward

F64 = torch.float64
TF5 = int(transformers.__version__.split(".")[0]) >= 5


def _seqs(n_prompt=150, lens=(9, 4, 13), seed=0, vocab=61):
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(1, vocab, (n_prompt,), generator=g)
    return [torch.cat([p, torch.randint(1, vocab, (n,), generator=g)]) for n in lens]


def _alone(stock, seqs, temperature=1.0) -> torch.Tensor:
    """[N, T] log-probs of each sequence alone (entry t: token t given the tokens before it; 0 at t = 0)."""
    out = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=F64)
    for i, s in enumerate(seqs):
        out[i, 1:len(s)] = logprobs_alone(stock, s, temperature=temperature).double()
    return out


# ------------------------------------------------------------------ meta device
def _meta_twin(model, build=torch.device("meta")):
    with build:
        return type(model)(copy.deepcopy(model.config))


def test_a_meta_model_is_refused_before_any_forward(tiny_model):
    seqs = _seqs(n_prompt=20)
    meta = flexgroup.patch(_meta_twin(tiny_model("llama")))
    forwards = []
    meta.register_forward_pre_hook(lambda *a: forwards.append(1))
    batch = GroupedBatch.from_groups([seqs[0][:20]], [[s[20:] for s in seqs]])
    calls = {
        "flexgroup.stream": lambda: flexgroup.stream_logprobs(meta, seqs, budget=128),
        "flexgroup.stream ": lambda: flexgroup.stream_backward(meta, seqs, lambda lp, i: lp.sum(), budget=128),
        "score": lambda: flexgroup.score(meta, [seqs[0][:20]], [[s[20:] for s in seqs]]),
        "verify": lambda: flexgroup.verify(meta, batch),
    }
    for where, call in calls.items():
        with pytest.raises(ValueError, match=rf"^{where.strip()}: the model is on the meta device \(parameter "
                                             r"'model.embed_tokens.weight' has a shape but no data\).*from_pretrained"):
            call()
    assert not forwards


def test_following_the_fix_gives_each_sequence_alones_logprobs(tiny_model):
    pytest.importorskip("accelerate")
    from accelerate import init_empty_weights

    stock = tiny_model("llama", F64)
    seqs = _seqs()
    # a model built on torch's meta device keeps meta buffers even after assign=True: still refused, by name
    bare = _meta_twin(stock)
    bare.load_state_dict(stock.state_dict(), assign=True)
    with pytest.raises(ValueError, match=r"buffer 'model.rotary_emb.inv_freq'"):
        flexgroup.stream_logprobs(flexgroup.patch(bare), seqs, budget=128)
    # the fix the message names: init_empty_weights() keeps buffers real; assign=True loads the parameters
    model = _meta_twin(stock, init_empty_weights())
    model.load_state_dict(stock.state_dict(), assign=True)
    lp = flexgroup.stream_logprobs(flexgroup.patch(model, backend="sdpa"), seqs, budget=128)
    assert (lp.double() - _alone(stock, seqs)).abs().max() < 1e-10


# ------------------------------------------------------------------ integer-tensor temperature
@pytest.mark.parametrize("temperature", [torch.tensor(2), torch.tensor([2], dtype=torch.int32), 2])
def test_an_integer_tensor_temperature_is_that_temperature_everywhere(temperature, tiny_model, hf_oracle,
                                                                       precision_for):
    ctx, atol, rel = precision_for(F64)
    seqs = _seqs(lens=(9, 4))
    P = 150
    with ctx:
        stock = tiny_model("llama", F64)
        model = flexgroup.patch(hf_oracle.stock_copy(stock), backend="sdpa")
        ref = _alone(stock, seqs, temperature=2.0)
        ref[:, :P] = 0
        ref.sum().backward()
        batch = GroupedBatch.from_groups([seqs[0][:P]], [[s[P:] for s in seqs]])
        lp = batch.logprobs(model(**batch.model_inputs()).logits, temperature=temperature)
        lp.sum().backward()
        streamed = flexgroup.stream_logprobs(model, seqs, budget=128, temperature=temperature)
        scored = flexgroup.score(model, [seqs[0][:P]], [[s[P:] for s in seqs]], temperature=temperature).logprobs
    for i, s in enumerate(seqs):
        r = len(s) - P
        for got in (lp[i, :r], streamed[i, P:len(s)], scored[i]):
            assert (got.double() - ref[i, P:len(s)]).abs().max() <= atol
    hf_oracle.assert_grads_close(hf_oracle.grads(model), hf_oracle.grads(stock), rel)


def test_an_integer_tensor_budget_is_that_budget(tiny_model, hf_oracle, precision_for):
    ctx, atol, _ = precision_for(F64)
    seqs = _seqs(lens=(9, 4))
    with ctx:
        stock = tiny_model("llama", F64)
        model = flexgroup.patch(hf_oracle.stock_copy(stock), backend="sdpa")
        res = stream_forward(model, seqs, budget=torch.tensor(128, dtype=torch.int32))
        ref = _alone(stock, seqs)
    assert res.forwards > 1 and (res.logprobs.double() - ref).abs().max() <= atol
    with pytest.raises(ValueError, match="budget must be an integer"):
        flexgroup.stream_logprobs(model, seqs, budget=torch.tensor(128.0))


@pytest.mark.parametrize("bad, message", [
    (torch.tensor(True), "got a torch.bool tensor"),
    (torch.tensor(1 + 1j), "got a torch.complex64 tensor"),
    (torch.tensor(0), "must be > 0 and finite"),
    (torch.tensor(-2), "must be > 0 and finite"),
    (torch.tensor([2, 3]), "must be > 0 and finite"),
])
def test_a_tensor_temperature_that_is_no_positive_real_number_is_refused(bad, message, tiny_model):
    seqs = _seqs(n_prompt=10, lens=(3,))
    model = flexgroup.patch(tiny_model("llama"))
    batch = GroupedBatch.from_sequences(seqs)
    logits = torch.randn(1, batch.num_tokens, 61)
    for call in (lambda: batch.logprobs(logits, temperature=bad),
                 lambda: flexgroup.stream_logprobs(model, seqs, budget=128, temperature=bad),
                 lambda: flexgroup.score(model, [seqs[0][:10]], [[seqs[0][10:]]], temperature=bad)):
        with pytest.raises(ValueError, match=message):
            call()


# ------------------------------------------------------------------ length-dependent RoPE scaling
def _dynamic(tiny_model, dtype=torch.float32, max_positions=256):
    rope = dict(rope_type="dynamic", factor=4.0)
    kw = {"rope_parameters": {**rope, "rope_theta": 10000.0}} if TF5 else {"rope_scaling": rope}
    return tiny_model("llama", dtype, max_position_embeddings=max_positions, **kw)


def test_streaming_past_dynamic_rope_scaling_names_it_and_its_config_field(tiny_model):
    model = flexgroup.patch(_dynamic(tiny_model, max_positions=128))
    field = "rope_parameters" if TF5 else "rope_scaling"
    with pytest.raises(NotImplementedError, match=rf"rope_type='dynamic' in config\.{field} \(NTK scaling .* "
                                                  r"max_position_embeddings=128\)\), and a sequence of 163 tokens"):
        flexgroup.stream_logprobs(model, _seqs(), budget=128)


def test_streaming_within_dynamic_rope_scaling_equals_each_sequence_alone(tiny_model, hf_oracle, precision_for):
    ctx, atol, _ = precision_for(F64)
    seqs = _seqs()
    with ctx:
        stock = _dynamic(tiny_model, F64)
        model = flexgroup.patch(hf_oracle.stock_copy(stock), backend="sdpa")
        res = stream_forward(model, seqs, budget=128)
        ref = _alone(stock, seqs)
    assert res.forwards > 1
    assert (res.logprobs.double() - ref).abs().max() <= atol


def test_patching_a_meta_model_outside_the_registry_names_the_device_not_a_failed_self_check(tiny_model):
    with pytest.raises(ValueError, match=r"^flexgroup.patch \(the generic self-check of 'olmo2' runs the model; patch "
                                         r"after loading\): the model is on the meta device"):
        flexgroup.patch(_meta_twin(tiny_model("olmo2")))
