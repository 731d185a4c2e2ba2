"""The shared readout (issue 39 item 1, invariant 10): each distinct logit row's log-sum-exp once, each distinct
(row, target) pair's log-prob once, its k readers' gradients summed into it.

Oracles: one plain ``log_softmax`` per read on a copy of the logits (unit level); every sequence alone through
the stock, unpatched model, log-probs and entropies from its own logits (model level).
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.data import readout
from flexgroup.data.fused_readout import hidden_forward
from flexgroup.data.readout import read_plan, read_scores
from flexgroup.reference.oracle import logits_alone

VOCAB = 61  # tests/conftest.py's tiny vocabulary


def _per_read(logits, rows, targets, temperature):
    """The repeated computation: one log-softmax and one entropy per read, [T] each."""
    x = logits[rows] / temperature                                          # [T, V], a copy per read
    logp = torch.log_softmax(x, -1)
    return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _reads(n=9):
    """Reads with a row read by several sequences for one target, a branch row read for several targets,
    and rows nobody reads: ``(rows [T], targets [T])``."""
    rows = torch.tensor([0, 0, 0, 2, 2, 2, 2, 5, 7, 7, 3, 8, 8, 8])
    targets = torch.tensor([4, 4, 4, 1, 9, 1, 1, 0, 3, 3, 3, 2, 6, 2])
    return rows[rows < n], targets[rows < n]


def test_read_plan_folds_reads_into_distinct_rows_and_pairs():
    rows, targets = _reads()
    plan = read_plan(rows, targets)
    assert plan.rows.tolist() == [0, 2, 3, 5, 7, 8]
    pairs = list(zip(plan.rows[plan.pair_row].tolist(), plan.pair_target.tolist()))
    assert pairs == [(0, 4), (2, 1), (2, 9), (3, 3), (5, 0), (7, 3), (8, 2), (8, 6)]
    assert [pairs[j] for j in plan.reader.tolist()] == list(zip(rows.tolist(), targets.tolist()))


@pytest.mark.parametrize("chunk", [1, 2, 4096])
@pytest.mark.parametrize("n", [9, 6], ids=["some-rows", "every-row"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_read_scores_equal_one_log_softmax_per_read_in_values_and_gradients(chunk, n, temperature):
    g = torch.Generator().manual_seed(0)
    rows, targets = _reads(n)
    if n == 6:
        rows = torch.searchsorted(torch.unique(rows), rows)                 # every row of the logits read
        n = int(rows.max()) + 1
    logits = (3 * torch.randn(n, 11, generator=g, dtype=torch.float64)).requires_grad_()
    ref_logits = logits.detach().clone().requires_grad_()
    w, u = torch.randn(2, rows.numel(), generator=g, dtype=torch.float64)
    lp, ent = read_scores(logits, read_plan(rows, targets), temperature, True, chunk_size=chunk)
    ref_lp, ref_ent = _per_read(ref_logits, rows, targets, temperature)
    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
    ((lp * w).sum() + (ent * u).sum()).backward()
    ((ref_lp * w).sum() + (ref_ent * u).sum()).backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-12, rtol=0)


def test_log_probs_alone_get_the_gradient_of_log_probs_alone():
    rows, targets = _reads()
    logits = torch.randn(9, 11, dtype=torch.float64, requires_grad=True)
    lp, ent = read_scores(logits, read_plan(rows, targets))
    assert ent is None
    lp.sum().backward()
    ref = logits.detach().clone().requires_grad_()
    _per_read(ref, rows, targets, 1.0)[0].sum().backward()
    torch.testing.assert_close(logits.grad, ref.grad, atol=1e-12, rtol=0)


def test_half_precision_logits_are_read_in_float32_and_get_their_gradient_in_their_own_dtype():
    rows, targets = _reads()
    logits = torch.randn(9, 11, dtype=torch.bfloat16, requires_grad=True)
    lp, ent = read_scores(logits, read_plan(rows, targets), return_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32
    ref = logits.detach().float().requires_grad_()
    ref_lp, ref_ent = _per_read(ref, rows, targets, 1.0)
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=0)
    (lp.sum() + ent.sum()).backward()
    (ref_lp.sum() + ref_ent.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad, ref.grad.bfloat16())


class _RowsThroughLogsumexp(TorchFunctionMode):
    """Counts the logit rows that go through ``torch.logsumexp`` or ``torch.log_softmax``."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.logsumexp, torch.log_softmax, torch.Tensor.log_softmax):
            self.rows += args[0].shape[0]
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------- model level
def _tree():
    """A multi-turn tree: branches at a turn boundary and mid-turn, a strict prefix (it ends inside a
    segment), a duplicate; with loss masks on assistant turns."""
    g = torch.Generator().manual_seed(1)

    def toks(n):
        return torch.randint(1, VOCAB, (n,), generator=g)

    system, user = toks(7), toks(4)
    a1, tool, a2 = toks(5), toks(3), toks(6)
    first = torch.cat([system, user, a1, tool, a2])
    branch_turn = torch.cat([system, user, a1, toks(2), toks(4)])
    branch_mid = torch.cat([system, user, a1[:2], toks(5)])
    other = torch.cat([system, toks(3), toks(6)])
    seqs = [first, branch_turn, first[:14], branch_mid, branch_turn.clone(), other]

    def assistant(s):   # every token after the user turn except the tool reply of the first trajectory
        m = torch.zeros(s.numel(), dtype=torch.bool)
        m[11:] = True
        if torch.equal(s[:19], first[:19]):
            m[16:19] = False
        return m
    return seqs, [assistant(s) for s in seqs]


def _readout_run(model, stock, seqs, masks, temperature, ctx, fused=False):
    """Grouped log-probs and entropies ([N, T]), and the same of each sequence alone (lists of [n_i - 1]);
    backward of one weighted loss through both, the same weights. ``fused``: read from the hidden states."""
    batch = GroupedBatch.from_sequences(seqs, masks)
    with ctx:
        if fused:
            out, head = hidden_forward(model, batch.model_inputs(needed_logits_only=True))
        else:
            out, head = model(**batch.model_inputs(needed_logits_only=True)).logits, None
        lp, ent = batch.logprobs(out, temperature=temperature, return_entropy=True, lm_head=head)
        dt = lp.dtype
        w = torch.linspace(-1.0, 1.5, lp.numel(), dtype=dt).view_as(lp)
        ((lp * w).sum() + (ent * w.flip(1)).sum() * 0.3).backward()
        refs = []
        for i, s in enumerate(seqs):
            x = logits_alone(stock, s)[:-1] / temperature                      # [n - 1, V] its own rows
            logp = torch.log_softmax(x, -1)
            r_lp, r_ent = logp.gather(1, s[1:, None])[:, 0], -(logp.exp() * logp).sum(-1)
            m = batch.response_mask[i, 1:s.numel()].to(dt)
            ((r_lp * m * w[i, 1:s.numel()]).sum() + (r_ent * m * w.flip(1)[i, 1:s.numel()]).sum() * 0.3).backward()
            refs.append((r_lp.detach(), r_ent.detach()))
    return batch, lp.detach(), ent.detach(), refs


def _check(batch, lp, ent, refs, model, stock, oracle, atol, rel):
    for i, (r_lp, r_ent) in enumerate(refs):
        m = batch.response_mask[i, 1:r_lp.numel() + 1]
        torch.testing.assert_close(lp[i, 1:r_lp.numel() + 1][m], r_lp[m], atol=atol, rtol=0)
        torch.testing.assert_close(ent[i, 1:r_ent.numel() + 1][m], r_ent[m], atol=atol, rtol=0)
    oracle.assert_grads_close(oracle.grads(model), oracle.grads(stock), rel)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("scored", ["every-token", "assistant-turns"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_a_fully_scored_multi_turn_tree_equals_each_sequence_alone(scored, dtype, fused, tiny_model, hf_oracle,
                                                                   precision_for):
    seqs, masks = _tree()
    masks = None if scored == "every-token" else masks
    model = tiny_model("llama", dtype=dtype).train()
    stock = hf_oracle.stock_copy(model)
    model = flexgroup.patch(model, backend="sdpa")
    ctx, atol, rel = precision_for(dtype)
    if dtype == torch.float64:
        atol, rel = 1e-12, 1e-12
    batch, lp, ent, refs = _readout_run(model, stock, seqs, masks, 0.8, ctx, fused)
    assert int(batch.response_mask.sum()) > batch.logit_rows.numel()   # rows really are read more than once
    _check(batch, lp, ent, refs, model, stock, hf_oracle, atol, rel)


@pytest.mark.parametrize("arch", ["gemma2", "granite"], ids=["softcapped", "logits-scaled"])
def test_the_fused_readout_of_a_model_that_transforms_its_logits_equals_each_sequence_alone(arch, tiny_model,
                                                                                             hf_oracle, precision_for):
    seqs, masks = _tree()
    model = tiny_model(arch, dtype=torch.float64).train()
    stock = hf_oracle.stock_copy(model)
    model = flexgroup.patch(model, backend="sdpa")
    ctx, _, _ = precision_for(torch.float64)
    batch, lp, ent, refs = _readout_run(model, stock, seqs, masks, 0.8, ctx, fused=True)
    _check(batch, lp, ent, refs, model, stock, hf_oracle, 1e-12, 1e-12)


def _unweighted(values, reader):
    """A broken readout: a pair read by k sequences gets one reader's gradient, not the sum of k."""

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v):
            ctx.shape = v.shape
            return v[reader]

        @staticmethod
        def backward(ctx, g):
            return torch.zeros(ctx.shape, dtype=g.dtype).index_put((reader,), g)   # no accumulate

    return Copy.apply(values)


def test_a_shared_pair_whose_gradient_is_not_weighted_by_its_readers_is_caught(monkeypatch, tiny_model, hf_oracle,
                                                                              precision_for):
    monkeypatch.setattr(readout, "_to_readers", _unweighted)
    seqs, _ = _tree()
    model = tiny_model("llama", dtype=torch.float64).train()
    stock = hf_oracle.stock_copy(model)
    model = flexgroup.patch(model, backend="sdpa")
    ctx, _, _ = precision_for(torch.float64)
    batch, lp, ent, refs = _readout_run(model, stock, seqs, None, 0.8, ctx)
    with pytest.raises(AssertionError, match="grad error"):
        _check(batch, lp, ent, refs, model, stock, hf_oracle, 1e-12, 1e-12)


def _first_pair_only(g_lp, pair_row, n, work, device):
    """A broken readout: a branch point's row (several targets read from it) weighs its softmax by one pair's
    gradient instead of the sum over its pairs."""
    g_row = torch.zeros(n, dtype=work, device=device)
    return g_row if g_lp is None else g_row.index_put_((pair_row,), g_lp.to(work))   # no accumulate: one pair


def test_a_branch_row_whose_softmax_gradient_counts_one_target_is_caught(monkeypatch):
    monkeypatch.setattr(readout, "row_sums", _first_pair_only)
    rows, targets = _reads()
    logits = torch.randn(9, 11, dtype=torch.float64, requires_grad=True)
    lp, _ = read_scores(logits, read_plan(rows, targets))
    lp.sum().backward()
    ref = logits.detach().clone().requires_grad_()
    _per_read(ref, rows, targets, 1.0)[0].sum().backward()
    torch.testing.assert_close(lp, _per_read(ref, rows, targets, 1.0)[0], atol=1e-12, rtol=0)  # values still right
    assert (logits.grad - ref.grad).abs().amax(-1)[[2, 8]].min() > 1e-3   # the two branch rows are wrong
    assert (logits.grad - ref.grad).abs().amax(-1)[[0, 3, 5, 7]].max() < 1e-12   # one target each: right


def test_each_distinct_row_goes_through_the_log_sum_exp_once(tiny_model):
    seqs, _ = _tree()
    batch = GroupedBatch.from_sequences(seqs)
    logits = torch.randn(1, batch.logit_rows.numel(), VOCAB, dtype=torch.float64)
    with _RowsThroughLogsumexp() as count:
        batch.logprobs(logits, return_entropy=True)
    reads = int(batch.response_mask.sum())
    assert count.rows == batch.logit_rows.numel() < reads


@pytest.mark.parametrize("needed_only", [True, False], ids=["needed-rows", "every-row"])
@pytest.mark.parametrize("entropy", [False, True])
def test_the_readout_saves_the_logits_themselves_and_no_copy_of_them_for_backward(needed_only, entropy):
    seqs, _ = _tree()
    batch = GroupedBatch.from_sequences(seqs)
    n = batch.logit_rows.numel() if needed_only else batch.num_tokens
    logits = torch.randn(1, n, 1024, requires_grad=True)   # besides the logits: index tensors, O(reads)
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        batch.logprobs(logits, return_entropy=entropy)
    logit_bytes = logits.numel() * logits.element_size()
    assert sum(seen.values()) <= 1.1 * logit_bytes
