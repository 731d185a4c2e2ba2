"""Every configuration flexgroup cannot make exact must raise a clear error -- never return numbers."""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.data.carrier import GroupedMask
from flexgroup.patches._interface import CacheNotSupported, flexgroup_attention


def _batch(groups, sizes=((9, [5, 3]),)):
    return GroupedBatch.from_groups(*groups(list(sizes)))


# --------------------------------------------------------------------------- unpatched models
@pytest.mark.parametrize("impl,op", [("sdpa", "aten.where"), ("eager", "aten.add"), ("flex_attention", "aten.alias")])
def test_unpatched_model_given_grouped_inputs_raises(impl, op, tiny_model, groups):
    model = tiny_model("llama")
    model.set_attn_implementation(impl)
    with pytest.raises(RuntimeError, match="call flexgroup.patch") as e:
        model(**_batch(groups).model_inputs())
    # the message names the op that touched the grouped mask: `op` on transformers 5.x; older
    # releases touch it first with another op (aten.slice on 4.56), which raises all the same
    assert op in str(e.value) or "aten." in str(e.value)


def test_unpatched_gemma2_eager_with_softcap_raises(tiny_model, groups):
    with pytest.raises(RuntimeError, match="not flexgroup's"):
        tiny_model("gemma2")(**_batch(groups).model_inputs())


def test_unpatch_restores_the_stock_implementation_and_the_guard(tiny_model, groups):
    model = tiny_model("qwen2")
    flexgroup.patch(model)
    flexgroup.unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, "_flexgroup") for m in model.modules())
    with pytest.raises(RuntimeError, match="call flexgroup.patch"):
        model(**_batch(groups).model_inputs())


def test_grouped_mask_refuses_every_tensor_op():
    m = GroupedMask(flexgroup.Layout.group(3, [2]))
    assert m.shape == (1, 1, 5, 5) and m.dtype == torch.bool and len(m.shape) == 4
    for op in (lambda: m.sum(), lambda: m[:, :, -2:], lambda: m.float(), lambda: m & m, lambda: ~m,
               lambda: torch.where(m, 0.0, -1.0), lambda: m.clone().sum(), lambda: m.detach()[:, :, -2:]):
        with pytest.raises(RuntimeError, match="not flexgroup's"):
            op()  # e.g. what flash-attention's unpadding does with a mask: sum / index
    assert "GroupedMask" in repr(m)
    # moving, detaching or cloning the carrier (what generic code does to a whole inputs dict) keeps it a carrier
    for same in (m.to("meta"), m.detach(), m.clone()):
        assert isinstance(same, GroupedMask) and same.grouped_layout == m.grouped_layout


# --------------------------------------------------------------------------- flash
def test_patch_refuses_a_flash_backend(tiny_model):
    with pytest.raises(ValueError, match="flash-attention kernels"):
        flexgroup.patch(tiny_model("llama"), backend="flash_attention_2")


def test_switching_to_flash_after_patch_is_refused_at_the_next_grouped_call(tiny_model, groups):
    model = tiny_model("mistral")
    flexgroup.patch(model)
    # what set_attn_implementation("flash_attention_2") would leave (flash_attn is not installed here)
    model.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(RuntimeError, match="'flash_attention_2', not flexgroup's"):
        model(**_batch(groups).model_inputs())


# --------------------------------------------------------------------------- training features
def test_attention_dropout_in_training_mode_raises(tiny_model, groups):
    model = tiny_model("qwen3", attention_dropout=0.1)
    flexgroup.patch(model, backend="sdpa")
    with torch.no_grad():
        model.eval()(**_batch(groups).model_inputs())  # eval mode: dropout is off, fine
    with pytest.raises(RuntimeError, match="attention dropout 0.1"):
        model.train()(**_batch(groups).model_inputs())


# --------------------------------------------------------------------------- inputs
def test_user_attention_mask_alongside_grouped_inputs_raises(tiny_model, groups):
    model = flexgroup.patch(tiny_model("llama"))
    inputs = _batch(groups).model_inputs()
    inputs["attention_mask"] = torch.ones(1, inputs["input_ids"].shape[1], dtype=torch.long)
    with pytest.raises(ValueError, match="user attention_mask"):
        model(**inputs)


@pytest.mark.parametrize("extra", [{"use_cache": True}, {"use_cache": None}, {"cache": "object"}])
def test_cache_alongside_grouped_inputs_raises(extra, tiny_model, groups):
    from transformers import DynamicCache

    model = flexgroup.patch(tiny_model("llama"))
    inputs = _batch(groups).model_inputs()
    if "cache" in extra:
        inputs.pop("use_cache")
        extra = {"cache": DynamicCache(config=model.config)}
    inputs.update(extra)
    with pytest.raises(CacheNotSupported, match="cache"):  # the one refusal: also a ValueError and a RuntimeError
        model(**inputs)


def test_cache_reaching_the_attention_function_raises(tiny_model):
    # a KV cache makes keys longer than the grouped layout: the attention function refuses
    model = flexgroup.patch(tiny_model("llama"))
    attn = model.model.layers[0].self_attn
    lay = flexgroup.Layout.group(3, [2])
    q = torch.randn(1, 4, 5, 8)
    kv = torch.randn(1, 2, 9, 8)
    with pytest.raises(CacheNotSupported, match="KV cache"):
        flexgroup_attention(attn, q, kv, kv, GroupedMask(lay), scaling=0.3)


def test_missing_virtual_position_ids_raise(tiny_model, groups):
    model = flexgroup.patch(tiny_model("llama"))
    inputs = _batch(groups).model_inputs()
    inputs.pop("position_ids")
    with pytest.raises(ValueError, match="virtual position_ids"):
        model(**inputs)


def test_positions_beyond_the_model_limit_raise(tiny_model, groups):
    model = flexgroup.patch(tiny_model("llama", max_position_embeddings=16))
    ok = _batch(groups, [(10, [6, 6])])  # last virtual position 15
    model(**ok.model_inputs())
    # 27 physical tokens but at most 17 virtual positions: it is the virtual position that counts
    too_long = _batch(groups, [(10, [7, 5, 5])])
    with pytest.raises(ValueError, match=r"virtual position 16.*< 16"):
        model(**too_long.model_inputs())


def test_empty_prompts_and_responses_are_named():
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        GroupedBatch.from_groups([ids, ids[:0]], [[ids], [ids]])
    with pytest.raises(ValueError, match=r"response 1 of prompt 1 \(response index 2\) is empty"):
        GroupedBatch.from_groups([ids, ids], [[ids], [ids, ids[:0]]])
    with pytest.raises(ValueError, match="prompt 0 has no responses"):
        GroupedBatch.from_groups([ids], [[]])
    pid, pm = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    cid, cm = torch.ones(2, 4, dtype=torch.long), torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"completion of row 1 .* is empty"):
        GroupedBatch.from_padded(pid, pm, cid, cm, group_size=2)


def test_batch_size_above_one_is_refused_by_the_attention_function(tiny_model):
    model = flexgroup.patch(tiny_model("llama"))
    attn = model.model.layers[0].self_attn
    q, kv = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match="batch size 1"):
        flexgroup_attention(attn, q, kv, kv, GroupedMask(flexgroup.Layout.group(3, [2])))


# --------------------------------------------------------------------------- stated facts vs. the model
def test_kwargs_disagreeing_with_the_stated_facts_raise(tiny_model, groups):
    model = flexgroup.patch(tiny_model("mistral", window=4))
    model.config.sliding_window = 6  # the module now passes 6; the patch states 4
    with pytest.raises(RuntimeError, match="sliding_window=6.*window=4"):
        model(**_batch(groups).model_inputs())


def test_gemma2_softcap_disagreement_raises(tiny_model, groups):
    model = flexgroup.patch(tiny_model("gemma2"))
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = 3.0
    with pytest.raises(RuntimeError, match="softcap=3.0"):
        model(**_batch(groups).model_inputs())


def test_cache_object_in_the_attention_kwargs_raises(tiny_model):
    from transformers import DynamicCache

    model = flexgroup.patch(tiny_model("llama"))
    attn = model.model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="KV cache"):
        flexgroup_attention(attn, q, kv, kv, GroupedMask(flexgroup.Layout.group(3, [2])),
                                         past_key_values=DynamicCache(config=model.config))


def test_unpatch_removes_every_hook_and_attribute_that_patch_added(tiny_model):
    model = tiny_model("llama")
    hooks = {name: (len(m._forward_pre_hooks), sorted(m.__dict__)) for name, m in model.named_modules()}
    flexgroup.unpatch(flexgroup.patch(model))
    assert {name: (len(m._forward_pre_hooks), sorted(m.__dict__)) for name, m in model.named_modules()} == hooks


def test_the_cache_refusal_is_one_exception_type_that_old_handlers_still_catch():
    assert issubclass(CacheNotSupported, ValueError) and issubclass(CacheNotSupported, RuntimeError)
