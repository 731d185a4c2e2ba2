"""Random ops outside attention are caught where they happen, not by module type: StarCoder2 applies
``F.dropout(..., p=config.residual_dropout, training=self.training)`` directly (no ``nn.Dropout`` to
find), and any module may call ``torch.rand``. A grouped forward that draws raises, naming the cause and
the fix, unless ``shared_prefix_dropout=True``; without draws (p = 0, eval mode) it is exact against
each sequence alone through the stock model.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.patches import _guards


def _starcoder2(residual_dropout=0.1, embedding_dropout=0.0, dtype=torch.float32):
    config = transformers.Starcoder2Config(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, residual_dropout=residual_dropout,
        embedding_dropout=embedding_dropout, attention_dropout=0.0, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.Starcoder2ForCausalLM(config).to(dtype).eval()


def _batch(groups):
    prompts, responses = groups([(9, [5, 3]), (4, [6])])
    return GroupedBatch.from_groups(prompts, responses), prompts, responses


def test_starcoder2_functional_residual_dropout_in_training_is_refused_naming_the_setting(groups):
    model = flexgroup.patch(_starcoder2(residual_dropout=0.1)).train()
    batch, _, _ = _batch(groups)
    with pytest.raises(RuntimeError, match=r"random op ran during a grouped forward \(training mode.*F\.dropout.*"
                                           r"residual_dropout=0\.1.*shared_prefix_dropout=True"):
        model(**batch.model_inputs())


def test_the_shared_draw_is_visible_a_groups_first_tokens_get_one_mask(groups):
    # the opt-in (and what the old module scan let through): both responses' first token is read from the
    # prompt's last row, under one dropout mask; run alone, each gets its own draw
    model = flexgroup.patch(_starcoder2(residual_dropout=0.3), shared_prefix_dropout=True).train()
    prompts, responses = groups([(9, [5, 5])])
    responses = [[responses[0][0], responses[0][0].clone()]]  # two identical responses
    batch = GroupedBatch.from_groups(prompts, responses)
    with torch.no_grad():
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        flexgroup.unpatch(model)
        alone = [torch.log_softmax(model(input_ids=torch.cat([prompts[0], r])[None]).logits[0, 8], -1)[r[0]]
                 for r in responses[0]]
    assert lp[0, 0] == lp[1, 0]
    assert abs(float(alone[0] - alone[1])) > 1e-3


@pytest.mark.parametrize("how", ["p0_training", "eval"])
def test_starcoder2_without_draws_is_exact(how, groups, hf_oracle, precision_for):
    ctx, atol, rel = precision_for(torch.float64)
    model = _starcoder2(residual_dropout=0.0 if how == "p0_training" else 0.1, embedding_dropout=0.0,
                        dtype=torch.float64)
    model.train(how == "p0_training")
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model, backend="sdpa")
    batch, prompts, responses = _batch(groups)
    adv = torch.linspace(-1.0, 1.5, batch.num_responses, dtype=torch.float64)
    with ctx:
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        _, ref = hf_oracle.run(stock, prompts, responses)
        (lp * adv[:, None]).sum().backward()
        hf_oracle.loss(ref, adv.tolist()).backward()
    assert max((lp[i, : len(r)] - r).abs().max().item() for i, r in enumerate(ref)) <= atol
    hf_oracle.assert_grads_close(hf_oracle.grads(model), hf_oracle.grads(stock), rel)


class Jitter(torch.nn.Module):
    """A custom module that draws in eval mode too (noise scaled to nothing, but a draw all the same)."""

    def forward(self, x):
        return x + 0.0 * torch.rand_like(x)


@pytest.mark.parametrize("where", ["decoder", "head"])
def test_a_custom_module_calling_torch_rand_is_refused_in_eval_mode_too(where, tiny_model, groups):
    model = tiny_model("llama")
    if where == "decoder":
        model.model.norm = torch.nn.Sequential(model.model.norm, Jitter())
    else:
        model.lm_head = torch.nn.Sequential(Jitter(), model.lm_head)
    flexgroup.patch(model)
    batch, _, _ = _batch(groups)
    name = "LlamaModel" if where == "decoder" else "LlamaForCausalLM"
    with pytest.raises(RuntimeError, match=f"{name}: a random op ran during a grouped forward \\(eval mode"):
        model(**batch.model_inputs())
    flexgroup.patch(model, shared_prefix_dropout=True)  # the explicit opt-in
    model(**batch.model_inputs())
    flexgroup.patch(model, shared_prefix_dropout=False)
    with torch.no_grad():
        model(input_ids=batch.input_ids[None])  # ungrouped inputs draw as they like


def test_a_grouped_forward_without_random_ops_leaves_the_generator_alone(tiny_model, groups):
    model = flexgroup.patch(tiny_model("llama")).train()
    batch, _, _ = _batch(groups)
    state = torch.get_rng_state()
    model(**batch.model_inputs())
    assert torch.equal(state, torch.get_rng_state())


def test_the_dropout_module_scan_is_not_repeated_on_every_forward(tiny_model, groups, monkeypatch):
    # Llama's forward slices self.layers[:n]: a new ModuleList re-registering every layer, every forward
    model = flexgroup.patch(tiny_model("llama")).train()
    batch, _, _ = _batch(groups)
    scans = []
    real = _guards.dropout_modules
    monkeypatch.setattr(_guards, "dropout_modules", lambda *a: scans.append(1) or real(*a))
    for _ in range(3):
        model(**batch.model_inputs())
    assert len(scans) <= 2  # the language model's and the wrapper's, at most once each
    model.lm_head = torch.nn.Sequential(torch.nn.Dropout(0.1), model.lm_head)  # a new module: scanned again
    with pytest.raises(RuntimeError, match=r"dropout is active.*lm_head\.0"):
        model(**batch.model_inputs())
