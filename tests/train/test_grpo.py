"""flexgroup.train.grpo against values worked out by hand (in the comments), not by the same code."""

import math

import pytest
import torch

from flexgroup.train.grpo import group_advantages, kl_k3, policy_loss

R2, R3 = math.sqrt(2.0), math.sqrt(3.0)


def close(actual, expected, tol=1e-12):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.to(torch.float64), expected, atol=tol, rtol=0)


# ---------------------------------------------------------------- advantages


def test_advantages_of_consecutive_groups_are_centred_and_std_scaled():
    # group [1, 3]: mean 2 -> [-1, 1]; unbiased std sqrt(((-1)^2 + 1^2) / 1) = sqrt(2)
    # group [0, 0]: no spread -> exactly 0 (even with eps = 0, no 0/0)
    a = group_advantages(torch.tensor([1.0, 3.0, 0.0, 0.0], dtype=torch.float64), group_size=2, eps=0.0)
    close(a, [-1 / R2, 1 / R2, 0.0, 0.0])


def test_advantages_by_group_ids_in_any_order():
    # id 7: rewards [1, 3] -> [-1, 1] / sqrt(2)
    # id 3: rewards [2, 2, 5], mean 3 -> [-1, -1, 2]; unbiased var (1 + 1 + 4) / 2 = 3
    r = torch.tensor([1.0, 2.0, 3.0, 2.0, 5.0], dtype=torch.float64)
    a = group_advantages(r, [7, 3, 7, 3, 3], eps=0.0)
    close(a, [-1 / R2, -1 / R3, 1 / R2, -1 / R3, 2 / R3])


def test_advantages_population_std_and_eps():
    # [1, 3]: population std 1 -> (-1, 1) / (1 + 0.5)
    a = group_advantages(torch.tensor([1.0, 3.0], dtype=torch.float64), group_size=2, unbiased=False, eps=0.5)
    close(a, [-1 / 1.5, 1 / 1.5])


def test_advantages_without_std_scaling_are_just_centred():
    # Dr.GRPO: [1, 3] -> [-1, 1]; [10, 20, 60] mean 30 -> [-20, -10, 30]
    r = torch.tensor([1.0, 3.0, 10.0, 20.0, 60.0], dtype=torch.float64)
    close(group_advantages(r, [0, 0, 1, 1, 1], scale="none"), [-1.0, 1.0, -20.0, -10.0, 30.0])


def test_a_singleton_group_gets_advantage_zero():
    # id 0 alone -> 0; id 1: [1, 2] -> [-0.5, 0.5] / sqrt(0.5)
    a = group_advantages(torch.tensor([5.0, 1.0, 2.0], dtype=torch.float64), [0, 1, 1], eps=0.0)
    close(a, [0.0, -0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)])
    assert not torch.isnan(a).any()


def test_a_singleton_group_raises_when_asked_and_names_the_group():
    with pytest.raises(ValueError, match=r"group 9 \(containing response 0\) has a single response"):
        group_advantages(torch.tensor([5.0, 1.0, 2.0]), [9, 1, 1], singleton="raise")


def test_equal_rewards_whose_mean_rounds_give_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point; the advantage must still be 0, not 1e-17 / eps
    a = group_advantages(torch.tensor([0.1, 0.1, 0.1]), group_size=3)
    assert torch.equal(a, torch.zeros(3))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "exactly one of group_ids"),
        (dict(group_size=3), "do not split into groups of 3"),
        (dict(group_size=0), "positive integer"),
        (dict(group_ids=[0, 1]), r"shape \[4\]"),
        (dict(group_size=2, scale="max"), "scale must be"),
    ],
)
def test_advantage_argument_errors_are_clear(kwargs, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(torch.ones(4), **kwargs)


# ---------------------------------------------------------------- policy loss
# Two responses, T = 3; response 1 has 2 tokens (its third entry is padding, NaN on purpose).
# ratios exp(logp - old_logp): response 0 -> [1.5, 0.5, 1.0], response 1 -> [1.1, 0.7, pad]
# advantages [1, -2], clip 0.2 -> range [0.8, 1.2]. Per-token -min(r A, clip(r) A):
#   response 0 (A = 1):  r 1.5 -> -min(1.5, 1.2) = -1.2 (clipped); r 0.5 -> -min(0.5, 0.8) = -0.5;
#                        r 1.0 -> -1.0
#   response 1 (A = -2): r 1.1 -> -min(-2.2, -2.2) = 2.2; r 0.7 -> -min(-1.4, -1.6) = 1.6 (clipped)
# sum = -1.2 - 0.5 - 1.0 + 2.2 + 1.6 = 1.1 over 5 tokens


def case():
    mask = torch.tensor([[True, True, True], [True, True, False]])
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, math.nan]], dtype=torch.float64, requires_grad=True)
    log_ratio = torch.tensor([[math.log(1.5), math.log(0.5), 0.0], [math.log(1.1), math.log(0.7), 0.0]],
                             dtype=torch.float64)
    old = logp.detach() - log_ratio
    return logp, old, torch.tensor([1.0, -2.0], dtype=torch.float64), mask


@pytest.mark.parametrize(
    "aggregation, extra, expected",
    [
        ("token-mean", {}, 1.1 / 5),
        ("sequence-mean", {}, ((-1.2 - 0.5 - 1.0) / 3 + (2.2 + 1.6) / 2) / 2),  # (-0.9 + 1.9) / 2
        ("fixed", {"max_len": 4}, 1.1 / (2 * 4)),
    ],
)
def test_policy_loss_aggregations_match_hand_values(aggregation, extra, expected):
    logp, old, adv, mask = case()
    loss = policy_loss(logp, old, adv, mask, aggregation=aggregation, **extra)
    assert loss.ndim == 0
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_policy_loss_gradient_is_zero_where_clipped_and_at_padding():
    # token-mean: d/dlogp of -r A / 5 is -r A / 5 where unclipped, 0 where the clip is active
    logp, old, adv, mask = case()
    policy_loss(logp, old, adv, mask).backward()
    expected = [[0.0, -0.5 / 5, -1.0 / 5], [2.2 / 5, 0.0, 0.0]]
    close(logp.grad, expected)


def test_clip_higher_widens_the_upper_bound_only():
    # clip_low 0.2, clip_high 0.6 -> [0.8, 1.6]: r 1.5 is no longer clipped (-1.5 instead of -1.2),
    # r 0.7 with A < 0 is still clipped at 0.8 -> sum = -1.5 - 0.5 - 1 + 2.2 + 1.6 = 0.8
    logp, old, adv, mask = case()
    loss = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.6)
    assert loss.item() == pytest.approx(0.8 / 5, abs=1e-12)


def test_on_policy_loss_is_minus_mean_advantage_and_gradient_is_plain_policy_gradient():
    # old_logp None -> ratio 1: loss = -(1*3 + (-2)*2) / 5 = 0.2; grad = -A / 5 at real tokens
    logp, _, adv, mask = case()
    loss = policy_loss(logp, None, adv, mask)
    assert loss.item() == pytest.approx(0.2, abs=1e-12)
    loss.backward()
    close(logp.grad, [[-0.2, -0.2, -0.2], [0.4, 0.4, 0.0]])


def test_per_token_advantages_are_accepted():
    logp, old, adv, mask = case()
    per_token = adv[:, None].expand(2, 3).clone()
    per_token[1, 2] = 123.0  # padding: must not matter
    a = policy_loss(logp, old, per_token, mask)
    assert a.item() == pytest.approx(1.1 / 5, abs=1e-12)


def test_kl_k3_values():
    # d = ref - logp: d = ln 2 -> 2 - ln2 - 1; d = -ln 2 -> 1/2 + ln 2 - 1; d = 0 -> 0
    logp = torch.zeros(3, dtype=torch.float64)
    ref = torch.tensor([math.log(2), -math.log(2), 0.0], dtype=torch.float64)
    close(kl_k3(logp, ref), [1 - math.log(2), math.log(2) - 0.5, 0.0])


def test_policy_loss_with_kl_term():
    # d = ref - logp per token: response 0 [0, ln2, -ln2] -> k3 [0, 1 - ln2, ln2 - 1/2] (sum 1/2),
    # response 1 [ln3, 0] -> [2 - ln3, 0]. token-mean: (1.1 + 0.1 * (1/2 + 2 - ln3)) / 5
    logp, old, adv, mask = case()
    d = torch.tensor([[0.0, math.log(2), -math.log(2)], [math.log(3), 0.0, 5.0]], dtype=torch.float64)
    ref = logp.detach() + d
    loss = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.1)
    assert loss.item() == pytest.approx((1.1 + 0.1 * (0.5 + 2 - math.log(3))) / 5, abs=1e-12)
    loss.backward()
    assert torch.isfinite(logp.grad).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(aggregation="sum"), "aggregation must be one of"),
        (dict(aggregation="fixed"), "needs max_len"),
        (dict(aggregation="fixed", max_len=2), "more than max_len = 2"),
        (dict(beta=0.1), "needs ref_logp"),
        (dict(clip_low=-0.1), ">= 0"),
    ],
)
def test_policy_loss_argument_errors_are_clear(kwargs, message):
    logp, old, adv, mask = case()
    with pytest.raises(ValueError, match=message):
        policy_loss(logp, old, adv, mask, **kwargs)


def test_sequence_mean_refuses_an_empty_response():
    logp, old, adv, mask = case()
    mask[1] = False
    with pytest.raises(ValueError, match="response 1 has no masked token"):
        policy_loss(logp, old, adv, mask, aggregation="sequence-mean")
