"""The tiny-model zoo (flexgroup.models.zoo): demo-size configs, unknown names, seeded weights, the FLOP model."""

import pytest
import torch

import flexgroup
from flexgroup.models.zoo import ARCHS, build_model, flops_per_token_and_pair, ideal_speedup, tiny_config, unavailable


@pytest.mark.parametrize("arch", ARCHS)
def test_demo_size_configs_build(arch):
    if unavailable(arch):
        pytest.skip(unavailable(arch))
    cfg = tiny_config(arch, size="demo")
    layers = 8 if arch == "nemotron_h" else 4  # NemotronH counts each mixer and its MLP as two layers
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (256, layers, 8)


def test_unknown_architecture_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown architecture 'gpt9'.*llama"):
        tiny_config("gpt9")


def test_build_model_is_a_function_of_the_seed():
    a, b, c = build_model("llama", seed=3), build_model("llama", seed=3), build_model("llama", seed=4)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_flops_of_the_demo_llama_by_hand():
    # d 256, Hq 8, Hkv 4, Dh 32, f 1024, 4 layers:
    # token: 2*256*(8+8)*32 + 2*256*256 + 6*256*1024 = 262144 + 131072 + 1572864 = 1966080 per layer
    # pair:  4*8*32 = 1024 per layer
    per_token, per_pair = flops_per_token_and_pair(tiny_config("llama", size="demo"))
    assert (per_token, per_pair) == (4 * 1966080.0, 4 * 1024.0)
    # one group P=2, R=[1]: baseline 3 tokens / 6 pairs, grouped the same -> ratio 1
    assert ideal_speedup(tiny_config("llama"), flexgroup.Layout.group(2, [1])) == pytest.approx(1.0)
