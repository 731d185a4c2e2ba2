"""float64_by_layer leaves the model as it found it: a module that caches tensors during forward (rotary cos/sin
tables kept as attributes, a call counter buffer bumped in place) would otherwise keep the float64 ones, and
the model's next ordinary run -- verify's float32 baseline, which runs on the same copy -- would not be the
stock run any more.

Oracle: an untouched twin of the model (a deep copy never run under float64_by_layer), run the same way."""

from __future__ import annotations

import copy

import torch
from conftest import VOCAB, make_tiny

from flexgroup.reference import layerwise
from flexgroup.verification.calibration import sequence_backward
from flexgroup.reference.layerwise import float64_by_layer

SEQ = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2))
R = 12


class CachingRotary(torch.nn.Module):
    """Stock rotary embedding whose (cos, sin) are computed once per position ids and kept as an attribute, with
    a buffer counting the calls in place -- the habits of many hand-written model files."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.register_buffer("calls", torch.zeros(1))
        self.key = None  # set during forward
        self.tables = None

    def forward(self, x, position_ids):
        self.calls += 1
        if self.key is None or not torch.equal(self.key, position_ids):
            self.key, self.tables = position_ids.clone(), self.inner(x, position_ids)
        return self.tables


def _model():
    model = make_tiny("llama")
    model.model.rotary_emb = CachingRotary(model.model.rotary_emb)
    return model


def _float32_run(model):
    for p in model.parameters():
        p.grad = None
    logits, lp = sequence_backward(model, SEQ, R, torch.ones(R, dtype=torch.bool), torch.tensor(0.5))
    return logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _layerwise_then_float32(model):
    with float64_by_layer(model):
        logits64, _ = sequence_backward(model, SEQ, R, torch.ones(R, dtype=torch.bool), torch.tensor(0.5))
    assert logits64.dtype == torch.float64
    return _float32_run(model)


def test_a_float32_run_after_a_layerwise_run_is_the_stock_run():
    model = _model()
    twin = copy.deepcopy(model)
    before = {k: (v.dtype, v.clone()) for k, v in model.named_buffers()}
    logits, grads = _layerwise_then_float32(model)
    ref_logits, ref_grads = _float32_run(twin)
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(grads[k], g) for k, g in ref_grads.items())
    rot = model.model.rotary_emb
    assert rot.calls.item() == twin.model.rotary_emb.calls.item() == 1  # the layerwise calls were undone
    assert {k: v.dtype for k, v in model.named_buffers()} == {k: d for k, (d, _) in before.items()}


def test_without_the_restore_the_float64_tables_stay(monkeypatch):
    """The broken variant: no restore, and the cached float64 tables leak into the next float32 run."""
    monkeypatch.setattr(layerwise._TensorState, "restore", lambda self: None)
    model = _model()
    twin = copy.deepcopy(model)
    try:
        differs = not torch.equal(_layerwise_then_float32(model)[0], _float32_run(twin)[0])
    except RuntimeError as e:  # here the float64 tables meet float32 values in stock attention
        differs = "dtype" in str(e)
    assert differs and model.model.rotary_emb.tables[0].dtype == torch.float64


def test_tensors_set_before_the_run_are_put_back_by_object():
    model = _model()
    _float32_run(model)                                    # the cache now holds float32 tables
    rot = model.model.rotary_emb
    key, tables = rot.key, rot.tables
    other = torch.arange(len(SEQ) + 3)[None]               # force a recomputation inside the run
    with float64_by_layer(model):
        rot(torch.zeros(1, 1, dtype=torch.float32), other)
        assert rot.tables[0].dtype == torch.float64
    assert rot.key is key and rot.tables is tables
