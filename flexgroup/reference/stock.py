"""What "stock" means for a model: the attention implementation that computes everything its config asks for.

The verify path (:mod:`flexgroup.verification`) builds its each-alone references with it and the model zoo
builds its models with it (:mod:`flexgroup.models.zoo`), so it lives below both.
"""

from __future__ import annotations

__all__ = ["stock_attention"]


def stock_attention(config) -> str:
    """The stock attention implementation that computes everything the config asks for.

    ``"eager"`` when the config softcaps attention logits (stock sdpa cannot), else ``"sdpa"``.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return "eager" if getattr(cfg, "attn_logit_softcapping", None) else "sdpa"
