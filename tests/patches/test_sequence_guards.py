"""Model-level guards judge each SEQUENCE of the batch, also one that ends inside a segment (a strict
prefix of another sequence, a duplicate): length-dependent RoPE (longrope) and the MoE load-balancing
weights. Oracle: each sequence alone through the stock, unpatched model (log-probs and every gradient),
and the stock model's aux loss over the right-padded batch of every sequence. Each guard has a broken
variant (switched off, or fed the tree's leaves as before) that the oracle catches.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.models.zoo import build_model, unavailable
from flexgroup.patches import _guards

HALF_DIM = 4  # head_dim 8 of the tiny models


def _longrope_llama(tiny_model, dtype=torch.float64):
    rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
                short_factor=[1.0 + 0.1 * i for i in range(HALF_DIM)],
                long_factor=[2.0 + 0.5 * i for i in range(HALF_DIM)])
    return tiny_model("llama", dtype=dtype, rope_parameters=rope, max_position_embeddings=64, head_dim=8)


def _ids(n, seed):
    return torch.randint(1, 61, (n,), generator=torch.Generator().manual_seed(seed))


def _alone(stock, seq):
    logits = stock(input_ids=seq[None], use_cache=False).logits[0]
    return torch.log_softmax(logits[:-1], -1).gather(1, seq[1:, None])[:, 0]  # [n - 1]


def _max_error(model, stock, seqs, ctx):
    """Max |grouped - alone| over every sequence's log-probs; also compares gradients (returned separately)."""
    batch = GroupedBatch.from_sequences(seqs)
    with ctx:
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        refs = [_alone(stock, s) for s in seqs]
        w = torch.linspace(-1.0, 1.5, len(seqs), dtype=lp.dtype)
        if lp.requires_grad:
            (lp * w[:, None]).sum().backward()
            sum(r.sum() * wi for r, wi in zip(refs, w)).backward()
    return max((lp[i, 1: len(s)] - r).abs().max().item() for i, (s, r) in enumerate(zip(seqs, refs)))


# a 20-token sequence (long factors: > 16) and its strict prefixes / duplicates
A = _ids(20, 0)


def _skip_unless_length_dependent(stock):
    """The guard-off variants need a stock longrope whose factors follow each sequence's length (transformers
    5.x); where the first 12 positions of a 20-token sequence read the same as 12 tokens alone, there is no
    wrong number to show."""
    with torch.no_grad():
        if torch.allclose(_alone(stock, A)[:11], _alone(stock, A[:12]), atol=1e-5, rtol=0):
            pytest.skip("this transformers' longrope does not depend on the sequence's length here")


@pytest.mark.parametrize("seqs", [[A, A[:18], A], [A[:14], A[:6], A[:6], _ids(9, 1)]], ids=["all_long", "all_short"])
def test_longrope_with_prefix_sequences_on_one_side_is_exact(seqs, tiny_model, hf_oracle, precision_for):
    ctx, atol, rel = precision_for(torch.float64)
    model = _longrope_llama(tiny_model)
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model, backend="sdpa")
    assert _max_error(model, stock, seqs, ctx) <= atol
    hf_oracle.assert_grads_close(hf_oracle.grads(model), hf_oracle.grads(stock), rel)


def test_longrope_short_sequence_that_is_a_prefix_of_a_long_one_is_refused(tiny_model):
    model = flexgroup.patch(_longrope_llama(tiny_model), backend="sdpa")
    batch = GroupedBatch.from_sequences([A, A[:12]])
    assert len(batch.layout.leaves) == 1  # the short sequence is no leaf: the old guard saw one 20-token path
    with pytest.raises(ValueError, match=r"longrope.*original_max_position_embeddings=16.*1 sequence\(s\) of <= 16 "
                                         r"tokens and 1 longer \(up to 20\)"):
        model(**batch.model_inputs())


def test_longrope_prefix_row_is_wrong_without_the_guard(monkeypatch, tiny_model, hf_oracle):
    model = _longrope_llama(tiny_model, torch.float32)
    stock = hf_oracle.stock_copy(model)
    _skip_unless_length_dependent(stock)
    flexgroup.patch(model, backend="sdpa")
    monkeypatch.setattr(_guards.ModelGuards, "check", lambda *a, **k: None)
    with torch.no_grad():
        assert _max_error(model, stock, [A, A[:12]], torch.no_grad()) > 1e-3


# ------------------------------------------------------------------------------------------ MoE aux loss
def _mixtral():
    config = transformers.MixtralConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
                                        attn_implementation="sdpa", experts_implementation="eager")
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).eval().double()


def _moe(kind):
    if kind == "mixtral":
        return _mixtral()
    if unavailable(kind):
        pytest.skip(unavailable(kind))
    return build_model(kind, dtype=torch.float64)


def _padded(seqs):
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return ids, mask


def _prefix_batch(vocab):
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(1, vocab, (n,), generator=g) for n in (13, 6, 9))
    # a strict prefix, a duplicate, a completion repeated (share="trie" style) and an unrelated sequence
    return [a, a[:10], torch.cat([a[:5], b]), torch.cat([a[:5], b]), a[:10], c]


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_next"])
def test_moe_aux_loss_with_prefix_and_duplicate_sequences_equals_the_padded_batch(kind, monkeypatch, hf_oracle,
                                                                                  precision_for):
    ctx, _, _ = precision_for(torch.float64)
    model = _moe(kind)
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model)
    seqs = _prefix_batch(model.config.vocab_size)
    batch = GroupedBatch.from_sequences(seqs)
    ids, mask = _padded(seqs)
    with ctx:
        ref = stock(input_ids=ids, attention_mask=mask, use_cache=False, output_router_logits=True).aux_loss
        got = model(**batch.model_inputs(), output_router_logits=True).aux_loss
        leaf_weights = batch.layout.sequence_counts().float()  # the old count: root-to-leaf paths only
        monkeypatch.setattr(_guards, "sequence_weights", lambda mask: leaf_weights)
        wrong = model(**batch.model_inputs(), output_router_logits=True).aux_loss
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    assert abs((wrong - ref).item()) > 1e-4  # the oracle tells the leaf count apart


def test_multiple_choice_where_one_choice_is_a_token_prefix_of_another_is_judged_per_choice(tiny_model, monkeypatch):
    # prompt 10 + choices of 3 and 13 tokens, the first a prefix of the second: sequences of 13 (<= 16) and 23
    model = _longrope_llama(tiny_model, torch.float32)
    _skip_unless_length_dependent(model)
    prompt, long_choice = A[:10], _ids(13, 2)
    with torch.no_grad(), pytest.raises(ValueError, match="longrope.*original_max_position_embeddings=16"):
        flexgroup.score(model, [prompt], [[long_choice[:3], long_choice]], backend="sdpa")
    with torch.no_grad():
        stock = [float(_alone(model, torch.cat([prompt, c]))[9:].sum()) for c in (long_choice[:3], long_choice)]
    monkeypatch.setattr(_guards.ModelGuards, "check", lambda *a, **k: None)  # the guard off: silently wrong
    with torch.no_grad():
        got = flexgroup.score(model, [prompt], [[long_choice[:3], long_choice]], backend="sdpa").sum_logprobs
    assert abs(float(got[0]) - stock[0]) > 1e-4 and abs(float(got[1]) - stock[1]) < 2e-5
