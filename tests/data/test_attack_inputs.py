"""``model_inputs()`` dicts own their tensors: editing one in place never changes a later forward.

A caller who masks ``input_ids`` in the returned dict, adds noise to ``pixel_values`` or rewrites
``logits_to_keep`` edits that call's inputs only. Before, the dicts of ``GroupedBatch.model_inputs()``,
its sharded variant (``shard=group``) and ``MultimodalGroupedBatch.model_inputs()`` (both) held views
of the batch's own tensors (``input_ids``, ``logit_rows``, the visual inputs, ...), so such an edit
silently changed every later forward from the batch (0.2 nats on a tiny Llama).

Checked for all four: no tensor of the dict shares memory with any tensor the batch holds (walked
through its attributes, lists, dicts and layout); after editing every tensor of one dict in place, a
fresh dict is equal to one taken before; and (text batch) the log-probs of a forward are unchanged.
Broken variant: a dict that keeps the old view of ``input_ids`` is caught by each check.
"""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch
from _gloo import NEEDS_GLOO, one_rank_group


def _batch_tensors(obj, seen=None, depth=0) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj``'s attributes (lists, tuples, dicts, nested objects; 3 levels)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 3:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("flexgroup"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for x in items for t in _batch_tensors(x, seen, depth + 1)]


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s memory; None for a tensor without one (the GroupedMask carrier, a meta tensor)."""
    try:
        return t.untyped_storage().data_ptr() if t.numel() else None
    except (RuntimeError, NotImplementedError):
        return None


def _aliases(inputs: dict, batch) -> list[str]:
    """Names of the dict's tensors that share memory with a tensor of the batch."""
    own = {_storage(t) for t in _batch_tensors(batch)} - {None}
    return sorted(k for k, v in inputs.items() if isinstance(v, torch.Tensor) and _storage(v) in own)


def _plain(inputs: dict) -> dict:
    """The dict's tensors with memory (the GroupedMask carrier has none), cloned."""
    return {k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor) and _storage(v) is not None}


def _vandalise(inputs: dict) -> None:
    """Edit every tensor of the dict in place (position_ids aside: an edit there is refused by design)."""
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and k != "position_ids" and _storage(v) is not None:
            v.copy_(torch.zeros_like(v) if v.is_floating_point() else (v + 1) % max(int(v.max()) + 1, 2))


def _check(make, batch) -> None:
    before = _plain(make())
    assert "input_ids" in before
    d = make()
    assert _aliases(d, batch) == [], f"tensors of model_inputs() alias the batch's own: {_aliases(d, batch)}"
    _vandalise(d)
    after = _plain(make())
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} changed after an in-place edit of an earlier dict"


def _text_batch():
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, 60, (n,), generator=g)  # noqa: E731
    return GroupedBatch.from_groups([ids(7), ids(4)], [[ids(3), ids(5)], [ids(2), ids(4), ids(1)]])


@pytest.mark.parametrize("needed_logits_only", [False, True])
def test_grouped_batch_inputs_are_copies(needed_logits_only):
    batch = _text_batch()
    _check(lambda: batch.model_inputs(needed_logits_only=needed_logits_only), batch)


def test_editing_the_dict_leaves_later_forwards_alone(tiny_model):
    model = flexgroup.patch(tiny_model("llama", torch.float64), backend="sdpa")
    batch = _text_batch()

    def lp(inputs):
        with torch.no_grad():
            return batch.logprobs(model(**inputs).logits)

    ref = lp(batch.model_inputs())
    d = batch.model_inputs()
    d["input_ids"][0, :5] = 0                     # the caller masks a few tokens for its own forward
    assert not torch.equal(lp(d), ref)
    assert torch.equal(lp(batch.model_inputs()), ref)


def test_broken_variant_an_aliased_input_ids_is_caught(tiny_model):
    """Broken on purpose: the dict holds a view of the batch's ``input_ids`` (the old code)."""
    model = flexgroup.patch(tiny_model("llama", torch.float64), backend="sdpa")
    batch = _text_batch()

    def old_inputs():
        return dict(batch.model_inputs(), input_ids=batch.input_ids[None])

    assert _aliases(old_inputs(), batch) == ["input_ids"]
    with pytest.raises(AssertionError, match="alias"):
        _check(old_inputs, batch)
    with torch.no_grad():
        ref = batch.logprobs(model(**old_inputs()).logits)
        old_inputs()["input_ids"][0, :5] = 0
        err = (batch.logprobs(model(**old_inputs()).logits) - ref).abs().max().item()
    assert err > 1e-3, err                           # a later forward changed: what the copies prevent


def test_from_layout_keeps_its_own_copy_of_the_row():
    lay = flexgroup.Layout.group(4, [2, 3])
    ids = torch.arange(3, 3 + lay.num_tokens)
    batch = GroupedBatch.from_layout(lay, ids)
    ids[0] = 99
    assert batch.input_ids[0].item() == 3


@NEEDS_GLOO
@pytest.mark.parametrize("needed_logits_only", [False, True])
def test_sharded_inputs_are_copies(needed_logits_only):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    batch = _text_batch()
    with one_rank_group() as group:
        _check(lambda: batch.model_inputs(needed_logits_only=needed_logits_only, shard=group), batch)


def _vl_batch():
    pytest.importorskip("transformers")
    from test_vl import case, make_vl

    from flexgroup.data.multimodal import MultimodalGroupedBatch

    model = make_vl("qwen2_vl")
    prompts, responses, vision = case("two_groups", "qwen2_vl")
    return MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)


@pytest.mark.parametrize("needed_logits_only", [False, True])
def test_multimodal_inputs_are_copies(needed_logits_only):
    batch = _vl_batch()
    d = batch.model_inputs()
    assert "pixel_values" in d and "image_grid_thw" in d
    _check(lambda: batch.model_inputs(needed_logits_only=needed_logits_only), batch)
    for i in range(batch.num_responses):
        _check(lambda: dict(batch.sequence_inputs(i), input_ids=batch.input_ids[batch.paths[i]].clone()), batch)


@NEEDS_GLOO
def test_multimodal_sharded_inputs_are_copies():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    batch = _vl_batch()
    with one_rank_group() as group:
        _check(lambda: batch.model_inputs(needed_logits_only=True, shard=group), batch)
