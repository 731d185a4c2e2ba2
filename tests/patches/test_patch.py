"""patch / unpatch: registry, idempotence, ordinary inputs on a patched model, the generic path."""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.patches import REGISTRY, is_patched
from flexgroup.patches.generic import NotSupported


def _padded_batch(vocab=61):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, :7] = 0
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen2", "granite"])
def test_patched_model_still_runs_ordinary_padded_inputs(arch, tiny_model):
    model = tiny_model(arch)
    stock = tiny_model(arch)
    flexgroup.patch(model)
    ids, mask = _padded_batch()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        ref = stock(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-6, rtol=0)


def test_patched_model_delegates_ungrouped_inputs_to_eager_when_it_was_eager(tiny_model):
    model = tiny_model("llama", attn_implementation="eager")
    stock = tiny_model("llama", attn_implementation="eager")
    flexgroup.patch(model)
    assert model.config._attn_implementation == "flexgroup_eager"
    ids, mask = _padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                                   stock(input_ids=ids, attention_mask=mask).logits[mask.bool()], atol=1e-6, rtol=0)


def test_patch_is_idempotent_and_unpatch_restores(tiny_model, groups):
    model = tiny_model("gemma2")
    assert flexgroup.patch(model) is model
    name = model.config._attn_implementation
    assert name == "flexgroup_eager" and is_patched(model)
    flexgroup.patch(model, backend="flex_eager")  # second patch: only the backend changes
    assert model.config._attn_implementation == name
    assert {m._flexgroup.backend for m in model.modules() if hasattr(m, "_flexgroup")} == {"flex_eager"}
    assert len(model.model._forward_pre_hooks) == 2  # the guards and the random-op watch, once each
    assert len(model.model._forward_hooks) == 1
    flexgroup.unpatch(model)
    assert model.config._attn_implementation == "eager" and not is_patched(model)
    assert len(model.model._forward_pre_hooks) == 0 and len(model.model._forward_hooks) == 0
    flexgroup.unpatch(model)  # no-op


def test_registry_covers_the_issue_architectures():
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2"} <= set(REGISTRY)


def test_qwen2_windows_follow_use_sliding_window_and_max_window_layers(tiny_model):
    model = flexgroup.patch(tiny_model("qwen2", window=5, num_hidden_layers=3, max_window_layers=1))
    assert [layer.self_attn._flexgroup.window for layer in model.model.layers] == [None, 5, 5]
    model = flexgroup.patch(tiny_model("qwen2", window=5, use_sliding_window=False))
    assert [layer.self_attn._flexgroup.window for layer in model.model.layers] == [None, None]


def test_gemma2_facts_alternate_windows_and_softcap_every_layer(tiny_model):
    model = flexgroup.patch(tiny_model("gemma2", window=5))
    facts = [layer.self_attn._flexgroup for layer in model.model.layers]
    assert [(f.window, f.softcap) for f in facts] == [(5, 2.0), (None, 2.0)]


# --------------------------------------------------------------------------- generic path
def test_generic_architectures_pass_the_self_check(tiny_model):
    for arch in ("olmo2", "granite"):
        model = tiny_model(arch)
        assert model.config.model_type not in REGISTRY
        flexgroup.patch(model)
        assert is_patched(model)
        assert all(m._flexgroup.from_kwargs for m in model.modules() if hasattr(m, "_flexgroup"))


def test_generic_phi3_with_a_sliding_window_passes_and_is_exact(hf_oracle, groups):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=3,
                        max_position_embeddings=128, attn_implementation="sdpa", pad_token_id=0)
    model = Phi3ForCausalLM(config).eval()
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model, backend="sdpa")
    prompts, responses = groups([(6, [5, 2])])
    batch = GroupedBatch.from_groups(prompts, responses)
    with torch.no_grad():
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        _, ref = hf_oracle.run(stock, prompts, responses)
    for i, r in enumerate(ref):
        torch.testing.assert_close(lp[i, : len(r)], r, atol=1e-5, rtol=0)


def test_generic_model_whose_rope_ignores_position_ids_is_refused(tiny_model, monkeypatch):
    model = tiny_model("olmo2")
    rope = model.model.rotary_emb
    original = type(rope).forward

    def physical_positions(self, x, position_ids):  # a model that computes its own positions
        return original(self, x, torch.arange(position_ids.shape[-1])[None])

    monkeypatch.setattr(type(rope), "forward", physical_positions)
    with pytest.raises(NotSupported, match=r"model type 'olmo2' .* failed the generic self-check: response 1"):
        flexgroup.patch(model)
    assert not is_patched(model) and model.config._attn_implementation == "sdpa"


def test_generic_model_without_decoder_layers_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_embd=32, n_layer=1, n_head=4, n_positions=64))
    with pytest.raises(NotSupported) as info:
        flexgroup.patch(model)
    message = str(info.value)
    # what, why, and what is supported -- not "please report it"
    assert "model type 'gpt2' (GPT2LMHeadModel) is not supported" in message
    assert "no such decoder layers" in message and "llama" in message and "qwen3_5_text" in message
    assert "report" not in message


def test_generic_model_with_chunked_attention_is_refused(tiny_model):
    model = tiny_model("granite")
    model.config.attention_chunk_size = 8  # a feature the generic path cannot read from the kwargs
    with pytest.raises(NotSupported, match="model type 'granite' .* chunked attention"):
        flexgroup.patch(model)


@pytest.mark.parametrize("kind", ["llama", "qwen2_vl"])
def test_patching_one_of_two_models_built_from_one_config_leaves_the_other_alone(kind, groups):
    """Issue 38 item 8: ``LlamaForCausalLM(cfg)`` twice (a reference model made from the policy's config) shared
    ``_attn_implementation``: after ``patch(policy)`` the twin's plain forward raised "was not prepared by
    flexgroup.patch" and ``patch(twin)`` "already runs 'flexgroup_sdpa'". Each patched model now switches a config
    of its own: the twin runs stock, and patches and runs grouped on its own."""
    import transformers as tf
    from flexgroup.models.zoo import tiny_config

    if kind == "llama":
        cfg, cls = tiny_config("llama"), tf.LlamaForCausalLM
        cfg._attn_implementation = "sdpa"
    else:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent))
        from test_vl import make_vl

        cfg, cls = make_vl("qwen2_vl").config, tf.Qwen2VLForConditionalGeneration
    torch.manual_seed(0)
    policy, twin = cls(cfg).eval(), cls(cfg).eval()
    twin.load_state_dict(policy.state_dict())
    ids = torch.randint(3, 100, (1, 12))
    stock = twin(input_ids=ids).logits
    flexgroup.patch(policy)
    torch.testing.assert_close(twin(input_ids=ids).logits, stock, rtol=0, atol=0)    # still stock, not refused
    flexgroup.patch(twin)
    prompts, responses = groups([(6, [3, 4])])
    batch = GroupedBatch.from_groups(prompts, responses)
    a = batch.logprobs(policy(**batch.model_inputs()).logits)
    b = batch.logprobs(twin(**batch.model_inputs()).logits)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert policy.config is not twin.config
