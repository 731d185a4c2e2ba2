"""The fused readout (issue 39 item 2): log-probs and entropies straight from hidden states and the LM head, chunk by
chunk, equal to one plain ``log_softmax`` per read of the logits computed whole (values and the gradients of the
hidden states, the head's weight and bias), never holding the logits for backward.

Oracle: the logits computed whole with plain torch ops (``softcap(scale * (h W^T + b)) / tau``), then one
``log_softmax`` per read. The model-level check (each sequence alone through the stock model, softcapped and
scaled logits included) is in ``test_shared_readout.py``.
"""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.data import fused_readout
from flexgroup.data.fused_readout import LMHead, hidden_forward, lm_head_of, read_scores_fused
from flexgroup.data.readout import read_plan, read_scores

ROWS = torch.tensor([0, 0, 0, 2, 2, 2, 2, 5, 7, 7, 3, 8, 8, 8])      # shared rows, branch rows, rows nobody reads
TARGETS = torch.tensor([4, 4, 4, 1, 9, 1, 1, 0, 3, 3, 3, 2, 6, 2])


def _oracle(h, head, rows, targets, temperature):
    """One log-softmax (and entropy) per read of the logits computed whole: ``(lp [T], ent [T])``."""
    x = torch.nn.functional.linear(h, head.weight, head.bias) * head.scale
    if head.softcap is not None:
        x = head.softcap * torch.tanh(x / head.softcap)
    logp = torch.log_softmax(x[rows] / temperature, -1)
    return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _leaves(dtype, bias, n=9, hidden=6, vocab=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    return [t.to(dtype).requires_grad_() if t is not None else None for t in (h, w, b)]


def _run(readout, h, w, b, scale, softcap, rows, targets, temperature, seed=1):
    """Values and the gradients of one weighted loss of log-probs and entropies: ``(lp, ent, grads)``."""
    lp, ent = readout(h, LMHead(w, b, scale, softcap), rows, targets, temperature)
    g = torch.Generator().manual_seed(seed)
    u, v = torch.randn(2, rows.numel(), generator=g, dtype=torch.float64).to(lp.dtype)
    ((lp * u).sum() + (ent * v).sum()).backward()
    return lp.detach(), ent.detach(), [t.grad for t in (h, w, b) if t is not None]


def _fused(chunk):
    return lambda h, head, rows, targets, tau: read_scores_fused(h, head, read_plan(rows, targets), tau, True, chunk)


@pytest.mark.parametrize("chunk", [1, 3, None])
@pytest.mark.parametrize("every_row", [False, True], ids=["some-rows", "every-row"])
@pytest.mark.parametrize("transform", [(1.0, None, False, 1.0), (0.6, None, True, 0.7), (1.3, 2.5, True, 1.0)],
                         ids=["plain", "scaled-bias-temperature", "softcapped"])
def test_fused_readout_equals_one_log_softmax_per_read_of_the_whole_logits(chunk, every_row, transform):
    scale, softcap, bias, tau = transform
    rows, targets = ROWS, TARGETS
    if every_row:
        rows = torch.searchsorted(torch.unique(rows), rows)             # every hidden row is read
    n = int(rows.max()) + 1
    leaves, ref_leaves = _leaves(torch.float64, bias, n), _leaves(torch.float64, bias, n)
    lp, ent, grads = _run(_fused(chunk), *leaves, scale, softcap, rows, targets, tau)
    r_lp, r_ent, r_grads = _run(_oracle, *ref_leaves, scale, softcap, rows, targets, tau)
    torch.testing.assert_close(lp, r_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, r_ent, atol=1e-12, rtol=0)
    for got, ref in zip(grads, r_grads, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)


def test_float32_fused_readout_is_within_float32_noise_of_the_float64_truth():
    lp, ent, grads = _run(_fused(2), *_leaves(torch.float32, True), 1.0, 3.0, ROWS, TARGETS, 0.9)
    r_lp, r_ent, r_grads = _run(_oracle, *_leaves(torch.float64, True), 1.0, 3.0, ROWS, TARGETS, 0.9)
    torch.testing.assert_close(lp.double(), r_lp, atol=2e-6, rtol=0)
    torch.testing.assert_close(ent.double(), r_ent, atol=2e-6, rtol=0)
    for got, ref in zip(grads, r_grads, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=0)


def test_bfloat16_fused_readout_equals_the_unfused_readout_of_its_bfloat16_logits():
    h, w, _ = _leaves(torch.bfloat16, False, hidden=16, vocab=50)
    h2, w2 = (t.detach().clone().requires_grad_() for t in (h, w))
    plan = read_plan(ROWS, TARGETS)
    lp, ent = read_scores_fused(h, LMHead(w), plan, 0.8, True, chunk_size=2)
    lp2, ent2 = read_scores(torch.nn.functional.linear(h2, w2), plan, 0.8, True)   # [9, 50] bfloat16 logits
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close((lp, ent), (lp2, ent2), atol=1e-6, rtol=0)
    (lp.sum() + ent.sum()).backward()
    (lp2.sum() + ent2.sum()).backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close((h.grad, w.grad), (h2.grad, w2.grad))      # bfloat16's own tolerance


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_still_do():
    h, w, _ = _leaves(torch.float64, False)
    w.requires_grad_(False)
    lp, _ = read_scores_fused(h, LMHead(w), read_plan(ROWS, TARGETS), chunk_size=2)
    lp.sum().backward()
    ref = h.detach().clone().requires_grad_()
    _oracle(ref, LMHead(w), ROWS, TARGETS, 1.0)[0].sum().backward()
    assert w.grad is None
    torch.testing.assert_close(h.grad, ref.grad, atol=1e-12, rtol=0)


def _off_by_one(hidden, rows, chunk):
    """A broken chunking: every chunk after the first starts one distinct row early (and ends one early)."""
    for a in range(0, rows.numel(), chunk):
        b = min(a + chunk, rows.numel())
        s = max(a - 1, 0) if a else 0
        yield a, b, hidden.index_select(0, rows[s:s + b - a])


def test_a_chunk_boundary_off_by_one_is_caught(monkeypatch):
    monkeypatch.setattr(fused_readout, "_hidden_chunks", _off_by_one)
    lp, ent, grads = _run(_fused(2), *_leaves(torch.float64, True), 1.0, None, ROWS, TARGETS, 1.0)
    r_lp, r_ent, r_grads = _run(_oracle, *_leaves(torch.float64, True), 1.0, None, ROWS, TARGETS, 1.0)
    assert (lp - r_lp).abs().max() > 1e-3
    assert (grads[1] - r_grads[1]).abs().max() > 1e-3


def test_the_fused_readout_saves_no_logits_for_backward():
    n, hidden, vocab = 64, 8, 4096
    h = torch.randn(n, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    rows = torch.arange(n).repeat_interleave(3)
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        read_scores_fused(h, LMHead(w), read_plan(rows, rows % vocab), return_entropy=True, chunk_size=16)
    held = sum(seen.values()) - h.numel() * 4 - w.numel() * 4        # beyond the caller's own tensors
    assert 0 < held < n * vocab * 4 / 50                                # the logits would be [n, V] float32


def _head_doubler(module, args, out):
    return out * 2                                                      # a logit transform no config field names


def test_a_model_whose_logits_are_not_its_head_of_its_hidden_states_is_refused(tiny_model):
    model = flexgroup.patch(tiny_model("llama", dtype=torch.float64), backend="sdpa")
    batch = GroupedBatch.from_sequences([torch.tensor([3, 4, 5, 6]), torch.tensor([3, 4, 7])])
    hidden, head = hidden_forward(model, batch.model_inputs(needed_logits_only=True))
    assert hidden.shape == (1, batch.head_rows.numel(), model.config.hidden_size)   # the rows logits would have
    assert head.weight is model.lm_head.weight and head.scale == 1.0 and head.softcap is None
    model.lm_head.register_forward_hook(_head_doubler)
    with pytest.raises(NotImplementedError, match="does not know"):
        hidden_forward(model, batch.model_inputs(needed_logits_only=True))


def _reshard(module, args, out):
    module.lm_head.weight.data = torch.empty(0, dtype=torch.float64)   # as ZeRO-3 / FSDP leave it after the forward


def test_a_head_weight_sharded_outside_the_forward_is_refused(tiny_model):
    model = flexgroup.patch(tiny_model("llama", dtype=torch.float64), backend="sdpa")
    model.register_forward_hook(_reshard)
    batch = GroupedBatch.from_sequences([torch.tensor([3, 4, 5, 6])])
    with pytest.raises(NotImplementedError, match="sharded outside the forward"):
        hidden_forward(model, batch.model_inputs(needed_logits_only=True))


def test_a_head_that_is_not_a_plain_linear_layer_is_refused(tiny_model):
    model = tiny_model("llama", dtype=torch.float64)
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(NotImplementedError, match="not a plain torch.nn.Linear"):
        lm_head_of(model)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_a_plan_reading_past_the_given_rows_is_refused_not_sliced(fused):
    """3 rows given for a plan that reads rows 0, 2 and 5: as many distinct rows as given, so the readers' slicing
    shortcut (rows 0..n-1, views) would read rows 0, 1, 2 -- before, silently those values; now refused."""
    h, w, _ = _leaves(torch.float64, False, n=3)
    plan = read_plan(torch.tensor([0, 2, 5, 5]), torch.tensor([1, 2, 3, 4]))
    with pytest.raises(RuntimeError, match="have 3 rows but the read plan reads a row >= 3"):
        read_scores_fused(h, LMHead(w), plan) if fused else read_scores(h @ w.T, plan)
    full = torch.cat([h.detach(), torch.randn(3, h.shape[1], dtype=h.dtype)])   # the rows it reads: accepted
    lp = read_scores_fused(full, LMHead(w), plan)[0] if fused else read_scores(full @ w.T, plan)[0]
    ref, _ = _oracle(full, LMHead(w, None, 1.0, None), torch.tensor([0, 2, 5, 5]), torch.tensor([1, 2, 3, 4]), 1.0)
    torch.testing.assert_close(lp, ref, atol=1e-12, rtol=0)
