"""Vision-language x LoRA (exact), and vision-language x streaming without its images (refused).

Oracle for LoRA: a deep copy of the PEFT-wrapped model taken before patching (stock, unpatched), given
each ``[P; R_i]`` alone with that prompt's own visual inputs; compared: per-response log-probs and every
gradient (the LoRA weights of the decoder *and* of the vision tower), float64 and float32. The broken
variant: the same oracle with its adapters disabled differs, so a grouped path that skipped the adapters
would fail the comparison.
"""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup.data.multimodal import MultimodalGroupedBatch

from test_vl import _baseline, case, make_vl

peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'flexgroup[peft]')")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_lora_on_decoder_and_vision_tower_equals_each_sequence_alone(dtype, precision_for, hf_oracle):
    ctx, atol, rel = precision_for(dtype)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                           target_modules=["q_proj", "v_proj", "qkv"])   # qkv: the vision tower's attention
    torch.manual_seed(1)
    model = peft.get_peft_model(make_vl("qwen2_5_vl", dtype), lora).train()
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model, backend="sdpa")
    prompts, responses, vision = case("mixed_groups", "qwen2_5_vl")
    batch = MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)
    adv = torch.linspace(-1.0, 1.5, batch.num_responses, dtype=dtype)
    with ctx:
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        (lp * adv[:, None]).sum().backward()
        # the unpatched model inside the PEFT wrapper (its adapter layers injected): PeftModel.forward's
        # (*args, **kwargs) signature would hide ``mm_token_type_ids`` from _baseline's keyword check
        inner = stock.base_model.model
        _, ref = _baseline(inner, prompts, responses, vision)
        hf_oracle.loss(ref, adv.tolist()).backward()
        with torch.no_grad(), stock.disable_adapter():
            _, without = _baseline(inner, prompts, responses, vision)
    for i, r in enumerate(ref):
        n = batch.response_lengths[i]
        assert (lp[i, :n] - r).abs().max() <= atol
    assert max((w - r).abs().max().item() for w, r in zip(without, ref)) > 1e3 * atol   # the broken variant
    got, want = hf_oracle.grads(model), hf_oracle.grads(stock)
    assert any("visual" in n and "lora" in n for n in want) and any("language_model" in n and "lora" in n
                                                                       for n in want), sorted(want)
    hf_oracle.assert_grads_close(got, want, rel)


def test_streaming_a_vision_language_tree_without_its_images_is_refused_naming_vision():
    # streaming x vision-language itself is exact (tests/stream/test_stream_vision.py); placeholders whose images
    # are not given would run with the placeholder token's embedding instead of the image's features
    model = flexgroup.patch(make_vl("qwen2_vl"), backend="sdpa")
    prompts, responses, vision = case("image", "qwen2_vl")
    seqs = [torch.cat([prompts[0], r]) for r in responses[0]]
    with pytest.raises(ValueError, match=r"stream_backward: sequence 0 holds image/video placeholder tokens but "
                                         r"vision= was not given"):
        flexgroup.stream_backward(model, seqs, lambda lp, i: lp.sum(), budget=128)
    lp = flexgroup.stream_logprobs(model, seqs, budget=128, vision=[vision[0]] * len(seqs))
    assert lp.shape == (len(seqs), max(len(s) for s in seqs))
