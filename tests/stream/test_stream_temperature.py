"""stream_backward / stream_logprobs with a sampling temperature, and streamed entropies.

Oracle: every sequence alone through a deep copy of the *unpatched* model, its logits divided by the
temperature, then ``log_softmax`` (log-probs) and ``-sum(p * log p)`` (entropies): float64, norms kept
in float64. Compared: log-probs, entropies and every parameter gradient, at a budget of one block
(the 150-token system prompt is cut into chunks) and one where every tree fits one forward.
"""

from __future__ import annotations

import pytest
import torch
from test_stream import _grads, _pair, agent_forest

import flexgroup
from flexgroup.reference.oracle import logits_alone

T = 0.7


def _alone(stock, seqs, masks, adv):
    """Per sequence alone at temperature T: log-probs [N, W], entropies [N, W] (0 off the mask), and the
    gradients of sum_i -adv_i * sum_t lp_i[t]."""
    W = max(s.numel() for s in seqs)
    lp_out = torch.zeros(len(seqs), W, dtype=torch.float64)
    ent_out = torch.zeros(len(seqs), W, dtype=torch.float64)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        logp = torch.log_softmax(logits_alone(stock, s)[:-1].double() / T, dim=-1)     # [S - 1, V]
        lp = logp.gather(1, s[1:, None])[:, 0]
        mm = m[1:].double()
        (-(lp * mm).sum() * adv[i]).backward()
        lp_out[i, 1:s.numel()] = (lp * mm).detach()
        ent_out[i, 1:s.numel()] = (-(logp.exp() * logp).sum(-1) * mm).detach()
    return lp_out, ent_out, {n: p.grad.detach().clone() for n, p in stock.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("budget, fused", [(128, False), (100_000, False), (128, True)])
def test_streamed_logprobs_and_entropies_at_a_temperature_equal_each_sequence_alone(budget, fused, tiny_model,
                                                                                   hf_oracle, precision_for):
    seqs, masks = agent_forest()
    model, stock = _pair(tiny_model, hf_oracle, "llama", torch.float64)
    ctx, atol, _ = precision_for(torch.float64)
    with ctx:
        lp, ent = flexgroup.stream_logprobs(model, seqs, loss_masks=masks, budget=budget, temperature=T,
                                            return_entropy=True, fused=fused)
        ref_lp, ref_ent, _ = _alone(stock, seqs, masks, torch.zeros(len(seqs), dtype=torch.float64))
    assert lp.shape == ent.shape == ref_lp.shape and not lp.requires_grad and not ent.requires_grad
    assert (lp.double() - ref_lp).abs().max().item() <= atol
    assert (ent.double() - ref_ent).abs().max().item() <= atol
    n = masks[0].numel()
    assert (ent[0, :n][masks[0]] > 0).all() and (ent[0, :n][~masks[0]] == 0).all() and (ent[0, n:] == 0).all()
    # the default is unchanged: a tensor, at temperature 1
    plain = flexgroup.stream_logprobs(model, seqs, loss_masks=masks, budget=budget)
    assert isinstance(plain, torch.Tensor) and (plain - lp).abs().max() > 1e-3


def test_stream_backward_at_a_temperature_gives_each_sequence_alones_gradients(tiny_model, hf_oracle, precision_for):
    seqs, masks = agent_forest(seed=1)
    model, stock = _pair(tiny_model, hf_oracle, "llama", torch.float64)
    ctx, atol, rel = precision_for(torch.float64)
    adv = torch.randn(len(seqs), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with ctx:
        res = flexgroup.stream_backward(model, seqs, lambda lp, i: -(lp * adv[i, None]).sum(), loss_masks=masks,
                                        budget=128, temperature=T)
        ref_lp, _, ref_grads = _alone(stock, seqs, masks, adv)
    assert res.forwards > 1 and res.entropy is None
    assert (res.logprobs.double() - ref_lp).abs().max().item() <= atol
    hf_oracle.assert_grads_close(_grads(model), ref_grads, rel)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "0.7", True])
def test_a_temperature_that_is_not_a_finite_positive_number_is_refused(bad, tiny_model):
    seqs, masks = agent_forest()
    model = flexgroup.patch(tiny_model("llama"), backend="sdpa")
    with pytest.raises(ValueError, match="temperature must be > 0 and finite"):
        flexgroup.stream_logprobs(model, seqs, loss_masks=masks, budget=128, temperature=bad)
