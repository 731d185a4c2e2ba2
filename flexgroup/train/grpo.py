"""Group-relative advantages and clipped policy-gradient losses (GRPO, DAPO, Dr.GRPO).

Pure PyTorch, no dependency on the rest of flexgroup: the functions take the right-padded
``[N, T]`` log-probs that :meth:`flexgroup.GroupedBatch.logprobs` returns (or any other source)
and a boolean ``[N, T]`` mask of real response tokens.

Padding entries of every ``[N, T]`` input are ignored by selection (``torch.where``), never by
multiplication, so a NaN or ``-inf`` in padding cannot leak into the loss or its gradient.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from ..layout.checks import is_int

__all__ = ["group_advantages", "policy_loss", "kl_k3", "AGGREGATIONS"]

AGGREGATIONS = ("token-mean", "sequence-mean", "fixed")
Aggregation = Literal["token-mean", "sequence-mean", "fixed"]


def _group_index(n: int, group_ids, group_size, device) -> torch.Tensor:
    """Dense group index ``[n]`` in ``0..num_groups-1`` from explicit ids or a group size."""
    if (group_ids is None) == (group_size is None):
        raise ValueError(
            "give exactly one of group_ids (one id per response) or group_size (consecutive groups); "
            f"got group_ids={'set' if group_ids is not None else None}, group_size={group_size!r}"
        )
    if group_size is not None:
        if not is_int(group_size, 1):
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        if n % group_size:
            raise ValueError(
                f"{n} rewards do not split into groups of {group_size}: pass group_ids for "
                "groups of different sizes, or check the number of responses per prompt"
            )
        return torch.arange(n, device=device) // group_size
    ids = torch.as_tensor(group_ids, device=device)
    if ids.shape != (n,):
        raise ValueError(f"group_ids must have shape [{n}] (one id per reward), got {tuple(ids.shape)}")
    if ids.is_floating_point():
        raise ValueError("group_ids must be integers (or any integer labels), got a floating-point tensor")
    return torch.unique(ids, return_inverse=True)[1]


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | Sequence[int] | None = None,
    *,
    group_size: int | None = None,
    scale: Literal["std", "none"] = "std",
    eps: float = 1e-4,
    unbiased: bool = True,
    singleton: Literal["zero", "raise"] = "zero",
) -> torch.Tensor:
    """Group-relative advantages: each reward minus its group's mean, optionally over its std.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` with ``scale="std"`` (GRPO), or ``A_i = r_i - mean_g``
    with ``scale="none"`` (Dr.GRPO). ``std_g`` is the unbiased (Bessel-corrected) standard deviation
    of the group by default, as in TRL; ``unbiased=False`` uses the population one.

    A group of one response has no relative signal: its advantage is exactly 0 with
    ``singleton="zero"`` (the default; its unbiased std, undefined, is never computed) and a
    ``ValueError`` naming the group with ``singleton="raise"``. A group whose rewards are all equal
    also gets advantages of exactly 0.

    Args:
        rewards: float tensor ``[N]``.
        group_ids: ``[N]`` integer labels (any values; equal label = same group), or
        group_size: ``G`` for consecutive groups ``[0..G-1], [G..2G-1], ...`` (``N % G == 0``).
        scale: ``"std"`` or ``"none"``.
        eps: added to the std before dividing.

    Returns:
        float tensor ``[N]``, same dtype and device as ``rewards``, no gradient to ``rewards``.
    """
    rewards = torch.as_tensor(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    if singleton not in ("zero", "raise"):
        raise ValueError(f"singleton must be 'zero' or 'raise', got {singleton!r}")
    rewards = rewards.detach()
    n = rewards.shape[0]
    gidx = _group_index(n, group_ids, group_size, rewards.device)
    num_groups = int(gidx.max()) + 1 if n else 0
    counts = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, gidx, torch.ones_like(rewards)
    )
    if singleton == "raise" and bool((counts == 1).any()):
        g = int(torch.nonzero(counts == 1)[0])
        member = int(torch.nonzero(gidx == g)[0])
        label = g if group_ids is None else torch.as_tensor(group_ids)[member].item()
        raise ValueError(
            f"group {label} (containing response {member}) has a single response: a group-relative "
            "advantage needs at least 2; use singleton='zero' to give it advantage 0"
        )
    sums = torch.zeros_like(counts).index_add_(0, gidx, rewards)
    hi = torch.full_like(counts, -torch.inf).scatter_reduce(0, gidx, rewards, "amax")
    lo = torch.full_like(counts, torch.inf).scatter_reduce(0, gidx, rewards, "amin")
    # A rounded mean of equal rewards can differ from them by an ulp, which the division by
    # (std + eps) would blow up: groups without spread (singletons included) get exactly 0.
    flat = (hi == lo)[gidx]
    centred = torch.where(flat, torch.zeros_like(rewards), rewards - (sums / counts)[gidx])
    if scale == "none":
        return centred
    sq = torch.zeros_like(counts).index_add_(0, gidx, centred * centred)
    denom = (counts - 1 if unbiased else counts).clamp_min(1)
    std = torch.sqrt(sq / denom)[gidx]
    return torch.where(flat, centred, centred / (std + eps))


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): ``exp(d) - d - 1`` with ``d = ref - logp``.

    Non-negative, unbiased for the KL when tokens are sampled from the policy (Schulman's k3).
    Shapes: any, equal; returns the same shape.
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    aggregation: Aggregation = "token-mean",
    max_len: int | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    normalizer: float | None = None,
) -> torch.Tensor:
    """Clipped policy-gradient loss (PPO surrogate) with an optional k3 KL penalty.

    Per token: ``ratio = exp(logp - old_logp)``,
    ``pg = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`` and
    ``l = pg + beta * kl_k3(logp, ref_logp)``. Aggregated over the masked tokens as

    - ``"token-mean"`` (DAPO): ``sum(l) / sum(mask)`` over the whole batch;
    - ``"sequence-mean"`` (GRPO): mean over responses of ``sum_t(l) / len_i``;
    - ``"fixed"`` (Dr.GRPO): ``sum(l) / (N * max_len)``, a constant normaliser that does not
      depend on the response lengths (``max_len`` required, e.g. the generation limit).

    Args:
        logp: ``[N, T]`` log-probs of the sampled tokens under the current policy (with gradient).
        advantages: ``[N]`` (one per response) or ``[N, T]`` (per token).
        mask: ``[N, T]`` bool (or 0/1), True at real response tokens.
        old_logp: ``[N, T]`` log-probs of the policy that sampled (no gradient is taken through
            it). ``None`` means on-policy: ``logp.detach()``, so the ratio is 1 and the loss's
            gradient is the plain policy gradient.
        clip_low, clip_high: clip range ``[1 - clip_low, 1 + clip_high]``; ``clip_high=None``
            uses ``clip_low`` (symmetric, GRPO); DAPO's clip-higher uses e.g. 0.2 / 0.28.
        ref_logp: ``[N, T]`` reference-policy log-probs for the KL term (needed when ``beta != 0``).
        beta: KL coefficient.
        normalizer: the divisor of the batch, given explicitly, for a loss computed in pieces (e.g.
            :func:`flexgroup.stream_backward` calls the loss once per forward): ``"token-mean"``
            divides the summed token losses by it (the masked tokens of the *whole* batch),
            ``"sequence-mean"`` divides the sum of per-response means by it (the number of
            responses of the whole batch), ``"fixed"`` divides the summed token losses by it
            (``N * max_len`` of the whole batch). Then the pieces' losses sum to the whole batch's
            loss and their gradients to its gradient. Default None: this call's own batch.

    Returns:
        0-d tensor.
    """
    if logp.ndim != 2:
        raise ValueError(f"logp must be [N, T], got shape {tuple(logp.shape)}")
    if mask.shape != logp.shape:
        raise ValueError(f"mask must have the shape of logp {tuple(logp.shape)}, got {tuple(mask.shape)}")
    mask = mask.to(torch.bool)
    n, t = logp.shape
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if clip_high is None:
        clip_high = clip_low
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low} and {clip_high}")
    advantages = torch.as_tensor(advantages, dtype=logp.dtype, device=logp.device).detach()
    if advantages.shape == (n,):
        advantages = advantages[:, None].expand(n, t)
    elif advantages.shape != (n, t):
        raise ValueError(f"advantages must be [N]={n} or [N, T]={(n, t)}, got {tuple(advantages.shape)}")
    if old_logp is None:
        old_logp = logp.detach()
    elif old_logp.shape != logp.shape:
        raise ValueError(f"old_logp must have shape {tuple(logp.shape)}, got {tuple(old_logp.shape)}")
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Select before exp: padding may hold anything (NaN, -inf) and must not reach the gradient.
    log_ratio = torch.where(mask, logp - old_logp.detach(), zero)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError(f"beta = {beta} needs ref_logp (the reference policy's [N, T] log-probs)")
        if ref_logp.shape != logp.shape:
            raise ValueError(f"ref_logp must have shape {tuple(logp.shape)}, got {tuple(ref_logp.shape)}")
        d_logp = torch.where(mask, logp, zero)
        d_ref = torch.where(mask, ref_logp.detach(), zero)
        per_token = per_token + beta * kl_k3(d_logp, d_ref)
    per_token = torch.where(mask, per_token, zero)

    lengths = mask.sum(dim=1)
    if normalizer is not None:
        if isinstance(normalizer, bool) or not float(normalizer) > 0:
            raise ValueError(f"normalizer must be a positive number (the whole batch's divisor), got {normalizer!r}")
        if aggregation == "sequence-mean":
            if bool((lengths == 0).any()):
                i = int(torch.nonzero(lengths == 0)[0])
                raise ValueError(f"response {i} has no masked token: sequence-mean divides by its length 0")
            return (per_token.sum(dim=1) / lengths.to(logp.dtype)).sum() / normalizer
        return per_token.sum() / normalizer
    if aggregation == "token-mean":
        total = int(lengths.sum())
        if total == 0:
            raise ValueError("mask selects no token: token-mean is undefined for an empty batch")
        return per_token.sum() / total
    if aggregation == "sequence-mean":
        if bool((lengths == 0).any()):
            i = int(torch.nonzero(lengths == 0)[0])
            raise ValueError(f"response {i} has no masked token: sequence-mean divides by its length 0")
        return (per_token.sum(dim=1) / lengths.to(logp.dtype)).mean()
    if max_len is None or not is_int(max_len, 1):
        raise ValueError(
            f"aggregation='fixed' needs max_len, a positive integer (e.g. the generation limit), "
            f"got {max_len!r}"
        )
    if int(lengths.max()) > max_len:
        raise ValueError(
            f"a response has {int(lengths.max())} tokens, more than max_len = {max_len}: the fixed "
            "normaliser must be at least the longest response"
        )
    return per_token.sum() / (n * max_len)
