"""Inputs that used to fail with unrelated errors: one line naming the argument and the fix, or exact.

- masks: ONE rule for every constructor (``flexgroup.layout.checks.bool_mask``): bool, or integer / floating
  values that are all 0 or 1; a 2 is refused everywhere, Hugging Face ``labels`` (-100) are named;
- sequences that are all 1 token long;
- ``copy.deepcopy`` / ``.detach()`` / ``.clone()`` of ``batch.model_inputs()``: the same numbers as each
  sequence alone through the stock model.
"""

from __future__ import annotations

import copy

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch, Layout

SEQ = torch.tensor([5, 6, 7, 8, 9])
LABELS = torch.tensor([-100, -100, 7, 8, 9])     # what a Hugging Face collator builds for SEQ


def _constructors(mask):
    """Every constructor that takes a mask, given ``mask`` [5] (over SEQ) in its own argument."""
    ones = torch.ones(1, 5, dtype=torch.long)
    return {
        "from_sequences": lambda: GroupedBatch.from_sequences([SEQ], [mask]),
        "from_padded_sequences loss_mask": lambda: GroupedBatch.from_padded_sequences(SEQ[None], ones, mask[None]),
        "from_padded_sequences attention_mask": lambda: GroupedBatch.from_padded_sequences(SEQ[None], mask[None]),
        "from_padded_sequences completion_mask": lambda: GroupedBatch.from_padded_sequences(
            SEQ[None], ones, completion_mask=mask[None]),
        "from_padded_sequences tool_mask": lambda: GroupedBatch.from_padded_sequences(
            SEQ[None], ones, completion_mask=torch.tensor([[0, 1, 1, 1, 1]]), tool_mask=mask[None]),
        "from_padded prompt_mask": lambda: GroupedBatch.from_padded(SEQ[None], mask[None], SEQ[None, :2],
                                                                    torch.ones(1, 2, dtype=torch.long), group_size=1),
        "from_padded completion_mask": lambda: GroupedBatch.from_padded(SEQ[None, :2], torch.ones(1, 2), SEQ[None],
                                                                        mask[None], group_size=1),
        "from_layout": lambda: GroupedBatch.from_layout(Layout.group(2, [3]), SEQ, mask),
    }


@pytest.mark.parametrize("where", list(_constructors(SEQ)))
def test_a_mask_value_of_2_is_refused_by_every_constructor(where):
    with pytest.raises(ValueError, match=r"holds values other than 0/1 \(2\): give a bool mask") as e:
        _constructors(torch.tensor([0, 1, 2, 1, 1]))[where]()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("where", ["from_sequences", "from_padded_sequences loss_mask", "from_layout"])
def test_hugging_face_labels_as_a_loss_mask_name_the_fix(where):
    with pytest.raises(ValueError, match=r"Hugging Face labels .*pass `labels != -100`"):
        _constructors(LABELS)[where]()
    batch = _constructors(LABELS != -100)[where]()               # the fix works
    assert batch.response_mask[0, :5].tolist() == [False, False, True, True, True]


# a valid mask for each argument (loss masks False at 0, padding masks padded on their side)
VALID = {"from_sequences": [0, 0, 1, 0, 1], "from_padded_sequences loss_mask": [0, 0, 1, 0, 1],
         "from_padded_sequences attention_mask": [1, 1, 1, 0, 0],
         "from_padded_sequences completion_mask": [0, 0, 1, 0, 1], "from_padded_sequences tool_mask": [1, 1, 0, 1, 1],
         "from_padded prompt_mask": [0, 0, 1, 1, 1], "from_padded completion_mask": [1, 1, 1, 0, 0],
         "from_layout": [0, 0, 1, 0, 1]}


@pytest.mark.parametrize("dtype", [torch.long, torch.float32])
@pytest.mark.parametrize("where", list(VALID))
def test_integer_and_float_zero_one_masks_equal_the_bool_mask(where, dtype):
    mask = torch.tensor(VALID[where])
    ref = _constructors(mask.bool())[where]()
    got = _constructors(mask.to(dtype))[where]()
    assert torch.equal(got.response_mask, ref.response_mask) and torch.equal(got.input_ids, ref.input_ids)


def test_sequences_that_are_all_one_token_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"all 2 sequences have 1 token.*give sequences of 2 or more tokens") as e:
        GroupedBatch.from_sequences([torch.tensor([3]), torch.tensor([4])])
    assert "\n" not in str(e.value)
    batch = GroupedBatch.from_sequences([torch.tensor([3]), SEQ])  # one of them: it simply reads nothing
    assert batch.response_mask.sum(1).tolist() == [0, 4]


def _copies():
    def deep(inputs):
        return copy.deepcopy(inputs)

    def detach(inputs):
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def clone(inputs):
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def saved(inputs):   # torch.save / torch.load (issue 38 item 9: loading bumps the version counter)
        import io

        buf = io.BytesIO()
        torch.save(inputs, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    def pickled(inputs):
        import pickle

        return pickle.loads(pickle.dumps(inputs))

    return {"deepcopy": deep, "detach": detach, "clone": clone, "saved": saved, "pickled": pickled}


@pytest.mark.parametrize("how", list(_copies()))
def test_copied_model_inputs_give_each_sequences_stock_log_probs(how, tiny_model, hf_oracle, groups):
    model = tiny_model("llama", torch.float64)
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model, backend="sdpa")
    prompts, responses = groups([(6, [3, 4]), (5, [2])])
    batch = GroupedBatch.from_groups(prompts, responses)
    with torch.no_grad():
        lp = batch.logprobs(model(**_copies()[how](batch.model_inputs())).logits)
        _, ref = hf_oracle.run(stock, prompts, responses)
    for i, r in enumerate(ref):
        torch.testing.assert_close(lp[i, :len(r)], r, atol=1e-10, rtol=0)


@pytest.mark.parametrize("how", ["deepcopy", "saved", "pickled"])
def test_an_in_place_edit_of_a_deep_copy_is_still_caught(tiny_model, how):
    model = flexgroup.patch(tiny_model("llama"), backend="sdpa")
    batch = GroupedBatch.from_groups([torch.tensor([1, 2, 3])], [[torch.tensor([4, 5]), torch.tensor([6])]])
    inputs = _copies()[how](batch.model_inputs())
    inputs["position_ids"][0, -1] += 1
    with pytest.raises(ValueError, match="modified in place"):
        model(**inputs)
