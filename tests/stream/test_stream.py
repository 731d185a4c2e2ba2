"""stream_backward / stream_logprobs: batches bigger than one forward (issue 21).

Oracle: every sequence alone through a deep copy of the *unpatched* model (stock attention; eager
for Gemma 2); the loss a sum over sequences, so its gradient is the sum of each sequence's own.
Compared: log-probs and every parameter gradient, float64 (norms kept in float64) and float32.
"""

from __future__ import annotations

import random

import pytest
import torch

import flexgroup
from flexgroup.train.grpo import policy_loss
from flexgroup.reference.oracle import logprobs_alone
from flexgroup.stream.chunk_carrier import ChunkContext

VOCAB = 61  # tests/conftest.py's tiny vocabulary


def agent_forest(seed: int = 0, system: int = 150) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A shared system prompt, two tasks, trajectories of several turns branching mid-turn and at turn
    boundaries, a strict prefix and a duplicate; loss masks on assistant tokens (random gaps)."""
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    def turns(k):
        t, a = [], []
        for _ in range(k):
            na, nt = rng.randint(15, 40), rng.randint(5, 20)
            t += toks(na) + toks(nt)
            a += [True] * na + [False] * nt
        return t, a

    sys_ = toks(system)
    seqs, roles = [], []
    for task in range(2):
        base = sys_ + toks(30 + 10 * task)
        t1, a1 = turns(3)
        cut = len(base) + 20  # inside the first assistant message: a mid-turn branch
        t2, a2 = turns(2)
        items = [(base + t1, [False] * len(base) + a1),
                 ((base + t1)[:cut] + t2, ([False] * len(base) + a1)[:cut] + a2),
                 ((base + t1)[: len(base) + 50], ([False] * len(base) + a1)[: len(base) + 50])]  # strict prefix
        if task == 0:
            items.append(items[1])  # duplicate
        for t, a in items:
            seqs.append(torch.tensor(t))
            m = torch.tensor([x and rng.random() < 0.9 for x in a])
            m[0] = False
            if not m.any():
                m[-1] = True
            roles.append(m)
    return seqs, roles


def _weighted_sum(lp, index, adv):
    return -(lp * adv[index.to(adv.device), None].to(lp.dtype)).sum()


def _alone(stock, seqs, masks, adv):
    """Log-probs [N, T] and gradients of sum_i -adv_i * sum_t lp_i[t] (masked), each sequence alone."""
    T = max(s.numel() for s in seqs)
    out = torch.zeros(len(seqs), T, dtype=torch.float64)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        lp = logprobs_alone(stock, s)
        mm = m[1:].to(lp.dtype)
        (-(lp * mm).sum() * adv[i].to(lp.dtype)).backward()
        out[i, 1: s.numel()] = (lp * mm).detach().double()
    return out, {n: p.grad.detach().clone() for n, p in stock.named_parameters() if p.grad is not None}


def _grads(model):
    return {n.replace("base_model.model.", ""): p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _check(model, stock, seqs, masks, budget, dtype, precision_for, hf_oracle, min_forwards=1, fused=False):
    ctx, atol, rel = precision_for(dtype)
    adv = torch.randn(len(seqs), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with ctx:
        res = flexgroup.stream_backward(model, seqs, lambda lp, i: _weighted_sum(lp, i, adv), loss_masks=masks,
                                        budget=budget, fused=fused)
        ref_lp, ref_grads = _alone(stock, seqs, masks, adv)
    assert res.forwards >= min_forwards
    assert bool((res.logprobs[~res.response_mask] == 0).all())
    err = (res.logprobs.double() - ref_lp).abs().max().item()
    assert err <= atol, f"log-prob error {err:.3g} at budget {budget}"
    hf_oracle.assert_grads_close(_grads(model), ref_grads, rel)
    return res


def _pair(tiny_model, hf_oracle, arch, dtype, **kw):
    model = tiny_model(arch, dtype, **kw)
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model, backend="sdpa")
    return model, stock


# ------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("budget", [128, 300, 100_000])
def test_llama_tree_streamed_at_any_budget_equals_each_sequence_alone(budget, dtype, tiny_model, hf_oracle,
                                                                      precision_for):
    seqs, masks = agent_forest()
    model, stock = _pair(tiny_model, hf_oracle, "llama", dtype)
    res = _check(model, stock, seqs, masks, budget, dtype, precision_for, hf_oracle)
    assert (res.forwards == 1) == (budget == 100_000)


@pytest.mark.parametrize("arch, dtype, budget", [("llama", torch.float64, 128), ("llama", torch.float32, 128),
                                                 ("llama", torch.float64, 100_000), ("gemma2", torch.float64, 128)])
def test_the_fused_readout_streams_exactly(arch, dtype, budget, tiny_model, hf_oracle, precision_for):
    seqs, masks = agent_forest()
    model, stock = _pair(tiny_model, hf_oracle, arch, dtype, **({"window": 40} if arch == "gemma2" else {}))
    res = _check(model, stock, seqs, masks, budget, dtype, precision_for, hf_oracle, fused=True)
    assert (res.forwards == 1) == (budget == 100_000)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_windowed_layers_reach_back_into_the_kept_keys_exactly(arch, dtype, tiny_model, hf_oracle, precision_for):
    # window 40 < the 150-token system prompt: windows cross chunk boundaries into kept keys
    seqs, masks = agent_forest(seed=1)
    model, stock = _pair(tiny_model, hf_oracle, arch, dtype, window=40)
    _check(model, stock, seqs, masks, 160, dtype, precision_for, hf_oracle, min_forwards=4)


@pytest.mark.parametrize("arch", ["qwen3", "olmo2", "granite"])
def test_other_architectures_stream_exactly(arch, tiny_model, hf_oracle, precision_for):
    # qwen3: q/k norms and a sliding layer; olmo2 / granite: the self-checked generic path (granite scales
    # attention, embeddings, residuals and logits)
    seqs, masks = agent_forest(seed=4)
    model, stock = _pair(tiny_model, hf_oracle, arch, torch.float64, **({"window": 40} if arch == "qwen3" else {}))
    _check(model, stock, seqs, masks, 128, torch.float64, precision_for, hf_oracle, min_forwards=5)


def test_a_prefix_longer_than_the_budget_runs_in_chunks_that_attend_to_earlier_chunks(tiny_model, hf_oracle,
                                                                                      precision_for):
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, VOCAB, (420,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(1, VOCAB, (n,), generator=g)]) for n in (30, 50, 5)]
    model, stock = _pair(tiny_model, hf_oracle, "llama", torch.float64)
    masks = [torch.arange(s.numel()) >= 1 for s in seqs]  # the prompt's tokens are in the loss too
    res = _check(model, stock, seqs, masks, 128, torch.float64, precision_for, hf_oracle)
    assert res.forwards == 4  # 420 prompt tokens in 4 chunks of <= 128, the responses (85) join the last


def test_a_tree_that_fits_the_budget_runs_as_one_packed_forward(tiny_model, hf_oracle, precision_for):
    seqs, masks = agent_forest(system=20)
    model, stock = _pair(tiny_model, hf_oracle, "llama", torch.float32)
    res = _check(model, stock, seqs, masks, 4096, torch.float32, precision_for, hf_oracle)
    assert res.forwards == 1


def test_detached_kept_keys_are_caught(tiny_model, hf_oracle, precision_for, monkeypatch):
    # the broken variant: kept K/V are detached (no gradient flows back to the shared prefix's forward)
    def record_detached(self, m, key, value):
        for piece, a, n in self.keep:
            self.store.kv[(piece, m)] = (key[:, :, a:a + n].detach(), value[:, :, a:a + n].detach())

    monkeypatch.setattr(ChunkContext, "_record", record_detached)
    seqs, masks = agent_forest()
    model, stock = _pair(tiny_model, hf_oracle, "llama", torch.float64)
    with pytest.raises(AssertionError, match="grad error"):
        _check(model, stock, seqs, masks, 128, torch.float64, precision_for, hf_oracle)


def test_stream_logprobs_equal_the_stock_model_and_leave_no_gradient(tiny_model, hf_oracle, precision_for):
    seqs, masks = agent_forest(seed=2)
    model, stock = _pair(tiny_model, hf_oracle, "qwen2", torch.float64, window=40)
    ctx, atol, _ = precision_for(torch.float64)
    with ctx:
        lp = flexgroup.stream_logprobs(model, seqs, loss_masks=masks, budget=128)
        ref, _ = _alone(stock, seqs, masks, torch.zeros(len(seqs), dtype=torch.float64))
    assert lp.shape == ref.shape and not lp.requires_grad
    assert (lp.double() - ref).abs().max().item() <= atol
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
def test_non_reentrant_gradient_checkpointing_streams_exactly(tiny_model, hf_oracle, precision_for):
    seqs, masks = agent_forest()
    model, stock = _pair(tiny_model, hf_oracle, "llama", torch.float32)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _check(model, stock, seqs, masks, 128, torch.float32, precision_for, hf_oracle, min_forwards=5)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
def test_reentrant_gradient_checkpointing_is_refused(tiny_model):
    seqs, masks = agent_forest()
    model = flexgroup.patch(tiny_model("llama").train(), backend="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(RuntimeError, match="use_reentrant': False"):
        flexgroup.stream_backward(model, seqs, lambda lp, i: lp.sum(), loss_masks=masks, budget=128)


def test_lora_adapter_streams_exactly(tiny_model, hf_oracle, precision_for):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("llama", torch.float32), lora).train()
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model, backend="sdpa")
    seqs, masks = agent_forest()
    ctx, atol, rel = precision_for(torch.float32)
    adv = torch.randn(len(seqs), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    res = flexgroup.stream_backward(model, seqs, lambda lp, i: _weighted_sum(lp, i, adv), loss_masks=masks,
                                    budget=128)
    ref_lp, ref = _alone(stock, seqs, masks, adv)
    assert (res.logprobs.double() - ref_lp).abs().max().item() <= atol
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == ref.keys() and any("lora" in n for n in got)
    hf_oracle.assert_grads_close(got, ref, rel)


def test_token_mean_grpo_with_a_global_normalizer_decomposes_over_chunks(tiny_model, hf_oracle, precision_for):
    seqs, masks = agent_forest()
    model, stock = _pair(tiny_model, hf_oracle, "llama", torch.float64)
    ctx, _, rel = precision_for(torch.float64)
    adv = torch.randn(len(seqs), generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    T = max(s.numel() for s in seqs)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, m in enumerate(masks):
        mask[i, : m.numel()] = m
    total = int(mask.sum())
    with ctx:
        old = flexgroup.stream_logprobs(model, seqs, loss_masks=masks, budget=128) - 0.05 * mask  # ratio != 1

        def loss_fn(lp, index):
            return policy_loss(lp, old[index], adv[index], mask[index], aggregation="token-mean", normalizer=total)

        res = flexgroup.stream_backward(model, seqs, loss_fn, loss_masks=masks, budget=128)
        rows = [torch.cat([torch.zeros(1, dtype=torch.float64), logprobs_alone(stock, s)]) for s in seqs]
        lp_ref = torch.stack([torch.nn.functional.pad(r, (0, T - r.numel())) for r in rows])
        ref_loss = policy_loss(lp_ref, old, adv, mask, aggregation="token-mean")  # the whole batch at once
        ref_loss.backward()
    assert res.forwards > 2
    assert abs(res.loss - ref_loss.item()) <= 1e-12 * max(1.0, abs(ref_loss.item()))
    hf_oracle.assert_grads_close(_grads(model), hf_oracle.grads(stock), rel)


def test_policy_loss_with_the_whole_batch_normalizer_sums_over_pieces_to_the_whole_loss():
    g = torch.Generator().manual_seed(0)
    lp, old = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g)
    adv, mask = torch.randn(6, generator=g), torch.rand(6, 9, generator=g) > 0.3
    for agg, norm in (("token-mean", int(mask.sum())), ("sequence-mean", 6), ("fixed", 6 * 9)):
        whole = policy_loss(lp, old, adv, mask, aggregation=agg, max_len=9)
        parts = sum(policy_loss(lp[s], old[s], adv[s], mask[s], aggregation=agg, max_len=9, normalizer=norm)
                    for s in (slice(0, 2), slice(2, 6)))
        assert torch.allclose(parts, whole, rtol=1e-6, atol=0), agg


# ------------------------------------------------------------------------------------------- refusals
def test_a_budget_below_one_block_is_refused(tiny_model):
    model = flexgroup.patch(tiny_model("llama"), backend="sdpa")
    with pytest.raises(ValueError, match=r"budget=64 is below one block of 128 tokens"):
        flexgroup.stream_backward(model, agent_forest()[0], lambda lp, i: lp.sum(), budget=64)


def test_a_loss_fn_returning_a_non_scalar_is_refused(tiny_model):
    model = flexgroup.patch(tiny_model("llama"), backend="sdpa")
    with pytest.raises(ValueError, match=r"loss_fn must return a 0-d tensor.*got \(\d+,\)"):
        flexgroup.stream_backward(model, agent_forest()[0], lambda lp, i: lp.sum(1), budget=128)


def test_a_loss_fn_not_connected_to_lp_is_refused(tiny_model):
    model = flexgroup.patch(tiny_model("llama"), backend="sdpa")
    w = next(model.parameters())
    with pytest.raises(ValueError, match="does not depend on lp"):
        flexgroup.stream_backward(model, agent_forest()[0], lambda lp, i: (w * 2).sum(), budget=128)


def test_sequences_on_another_device_are_refused(tiny_model):
    model = flexgroup.patch(tiny_model("llama"), backend="sdpa")
    seqs = [s.to("meta") for s in agent_forest()[0]]
    with pytest.raises(ValueError, match=r"sequence 0 is on meta but the model is on cpu"):
        flexgroup.stream_backward(model, seqs, lambda lp, i: lp.sum(), budget=128)


def test_an_unpatched_model_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"not patched: call flexgroup.patch"):
        flexgroup.stream_logprobs(tiny_model("llama"), agent_forest()[0], budget=128)
