"""flexgroup.score on a model without a head names the fix (it used to end in AttributeError 'logits')."""

from __future__ import annotations

import pytest
import torch

import flexgroup


def test_score_on_a_bare_decoder_names_the_model_to_pass(tiny_model):
    model = tiny_model("llama")
    with pytest.raises(TypeError, match=r"LlamaModel, neither a \*ForCausalLM .*not the bare decoder `model.model`") as e:
        flexgroup.score(model.model, [torch.tensor([1, 2, 3])], [[torch.tensor([4, 5])]])
    assert "\n" not in str(e.value)
    with torch.no_grad():
        assert flexgroup.score(model, [torch.tensor([1, 2, 3])], [[torch.tensor([4, 5])]]).sum_logprobs.shape == (1,)
