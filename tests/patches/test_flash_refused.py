"""Flash-style attention implementations are refused by ``patch`` with the fix, and left untouched.

flash-attn cannot be installed here, so each case sets the implementation name on the config
directly (as loading with ``attn_implementation=...`` would) or registers a fake flash-style kernel
with transformers' interfaces; ``patch`` must refuse before any model state changes.
"""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup.patches import is_patched


def _refused(model, name):
    with pytest.raises(ValueError) as info:
        flexgroup.patch(model)
    message = str(info.value)
    assert repr(name) in message and "attn_implementation='sdpa'" in message
    assert not is_patched(model)
    assert model.config._attn_implementation == name   # left as it was


@pytest.mark.parametrize("name", ["flash_attention_2", "flash_attention_3", "kernels-community/flash-attn3"])
def test_flash_implementations_are_refused_naming_the_fix(tiny_model, name):
    model = tiny_model("llama")
    model.config._attn_implementation = name
    _refused(model, name)


def test_a_registered_kernel_with_transformers_flash_mask_is_refused(tiny_model):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    def fake_kernel(module, q, k, v, mask, **kwargs):  # never reached: patch refuses first
        raise AssertionError("the fake kernel ran")

    AttentionInterface.register("my_fast_kernel", fake_kernel)
    AttentionMaskInterface.register("my_fast_kernel", flash_attention_mask)
    model = tiny_model("llama")
    model.config._attn_implementation = "my_fast_kernel"
    _refused(model, "my_fast_kernel")


def test_an_sdpa_model_patches_and_its_ordinary_forward_still_works(tiny_model):
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    before = model(input_ids=ids).logits
    flexgroup.patch(model)
    assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-6)
