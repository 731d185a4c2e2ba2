"""Per-token log-probs and entropies read out of logit rows (data): one formula for packed and streamed forwards.

No transformers import here.
"""

from __future__ import annotations

import torch

__all__ = ["token_scores"]

Tensor = torch.Tensor


def token_scores(x: Tensor, targets: Tensor, temperature: float = 1.0,
                 return_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of ``targets`` under the logit rows ``x``, divided by ``temperature``.

    Args:
        x: [c, V] logit rows (float32 or float64: callers upcast half precision), one per target.
        targets: LongTensor [c], the token each row predicts.
        temperature: logits are divided by it before the softmax (checked by the caller, > 0).
        return_entropy: also return the entropy of each row's distribution.

    Returns:
        ``(lp [c], ent [c] or None)``; ``lp[j] = log softmax(x[j] / temperature)[targets[j]]``. The
        entropy is computed from the rows shifted by their maximum, as TRL's fused LM head does
        (unshifted, ``lse - sum(p x)`` is biased low in float32).
    """
    if temperature != 1.0:
        x = x / temperature
    lp = x.gather(1, targets[:, None])[:, 0] - torch.logsumexp(x, dim=-1)
    if not return_entropy:
        return lp, None
    e = (z := x - x.amax(-1, keepdim=True).detach()).exp()       # log S - sum(e z) / S, S = sum(e)
    return lp, e.sum(-1).log() - (e * z).sum(-1) / e.sum(-1)
