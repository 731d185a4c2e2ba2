"""Models whose ``forward`` is a closure over the original (TRL 1.16's fused LM head does
``model.forward = MethodType(_fused_forward, model)`` closing over the original bound ``model.forward``,
trl/trainer/utils.py ``add_fused_lm_head``): a ``copy.deepcopy`` of such a model still runs the caller's.

verify and the generic path's self-check run their copies' own class forward, verify leaves the caller's
parameters and gradients alone (checked after) and fails when it compared nothing.
"""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.verification.equivalence import verify
from flexgroup.models.zoo import build_model
from flexgroup.reference.oracle import own_copy


def fuse_like_trl(model):
    """What TRL's ``add_fused_lm_head`` does to ``model.forward`` (its fused branch left out)."""
    original_forward = model.forward

    @functools.wraps(type(model).forward)
    def _fused_forward(self, *args, fused_lm_head=False, **kwargs):
        if fused_lm_head:
            raise NotImplementedError("the fused branch is not needed here")
        return original_forward(*args, **kwargs)

    model.forward = types.MethodType(_fused_forward, model)
    return model


def _batch(vocab=128):
    g = torch.Generator().manual_seed(0)
    ids = functools.partial(torch.randint, 0, vocab, generator=g)
    return GroupedBatch.from_groups([ids((12,)), ids((5,))], [[ids((4,)), ids((1,)), ids((6,))], [ids((3,))]])


def test_a_deep_copy_of_a_closure_forward_runs_the_original_but_own_copy_runs_its_own():
    model = fuse_like_trl(build_model("llama"))
    twin, notes = own_copy(model)
    assert "forward" not in twin.__dict__ and "TRL's fused LM head" in notes[0]
    plain = copy.deepcopy(model)
    x = torch.arange(1, 9)[None]
    plain(input_ids=x).logits.sum().backward()
    assert next(model.parameters()).grad is not None  # the deep copy wrote into the original


_ORIGINAL_FORWARD = None


def _forward_through_a_global(self, *args, **kwargs):
    return _ORIGINAL_FORWARD(*args, **kwargs)


def test_own_copy_also_sees_a_forward_that_reads_the_original_from_a_global(monkeypatch):
    model = build_model("llama")
    monkeypatch.setitem(globals(), "_ORIGINAL_FORWARD", model.forward)
    model.forward = types.MethodType(_forward_through_a_global, model)
    twin, notes = own_copy(model)
    assert "forward" not in twin.__dict__ and len(notes) == 1


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched_first"])
def test_verify_of_a_closure_forward_model_compares_its_copies_and_leaves_the_model_alone(patched):
    model = fuse_like_trl(build_model("llama"))
    if patched:  # what a trainer adapter hands over: trainer.model, patched
        flexgroup.patch(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = verify(model, _batch())
    assert report.ok, report.table()
    assert 0 < report["grads"].max_abs < 1e-4 and report["grads"].where != "nothing compared"
    assert any("TRL's fused LM head" in n for n in report.notes)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_verify_of_a_closure_forward_model_still_catches_a_leak(causal_over_packed_row):
    report = verify(flexgroup.patch(fuse_like_trl(build_model("llama"))), _batch())
    assert not report.ok and report["grads"].max_rel > 1e-2


def test_verify_with_no_gradient_to_compare_fails_saying_so():
    model = build_model("llama")
    for p in model.parameters():
        p.requires_grad_(False)
    report = verify(model, _batch(), calibration="none")
    assert not report.ok and not report["grads"].ok and report["logprobs"].ok
    assert "no parameter gradient was compared" in report.table() and "equivalent: no" in report.table()


def test_verify_refuses_a_verdict_when_the_callers_gradients_changed(monkeypatch):
    # the safety net: a copy that still runs the caller's modules (here: own_copy switched off)
    import flexgroup.verification.equivalence as eq

    monkeypatch.setattr(eq, "own_copy", lambda m, **_: (copy.deepcopy(m), []))
    model = fuse_like_trl(build_model("llama"))
    with pytest.raises(RuntimeError, match="verify changed the caller's model"):
        verify(flexgroup.patch(model), _batch(), calibration="none")
    assert all(p.grad is None for p in model.parameters())  # what it could undo, undone


@pytest.mark.parametrize("arch", ["olmo2", "granite"])
def test_generic_path_self_check_runs_the_copys_class_forward(arch, tiny_model, hf_oracle, precision_for):
    model = fuse_like_trl(tiny_model(arch))
    stock = hf_oracle.stock_copy(tiny_model(arch))
    flexgroup.patch(model, backend="sdpa")  # was: NotSupported (the self-check ran the unpatched original)
    _, atol, _ = precision_for(torch.float32)
    batch = _batch(vocab=61)
    with torch.no_grad():
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        for i, path in enumerate(batch.paths):
            seq = batch.input_ids[path]
            ref = torch.log_softmax(stock(input_ids=seq[None]).logits[0, :-1], -1).gather(1, seq[1:, None])[:, 0]
            r = batch.response_lengths[i]
            torch.testing.assert_close(lp[i, :r], ref[-r:], atol=atol, rtol=0)


@pytest.mark.slow
def test_trls_own_fused_lm_head_on_a_generic_architecture_patches_and_verifies(tiny_model):
    trl_utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(trl_utils, "add_fused_lm_head"):
        pytest.skip("this TRL has no fused LM head (add_fused_lm_head; TRL 0.20): nothing wraps forward")
    model = tiny_model("olmo2")
    trl_utils.add_fused_lm_head(model)
    assert isinstance(model.__dict__.get("forward"), types.MethodType)  # TRL still installs it this way
    flexgroup.patch(model, backend="sdpa")
    report = verify(model, _batch(vocab=61))
    assert report.ok, report.table()
    assert report["grads"].where != "nothing compared" and all(p.grad is None for p in model.parameters())
