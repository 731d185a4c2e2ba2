"""Which readout the TRL GRPO adapter uses for TRL's LM head, so that its log-probs are TRL's own.

TRL (``add_fused_lm_head``) computes the head under the trainer's autocast, or in float32 outside it with
``cast_lm_head_to_fp32=True``. The model's own logits (the logits readout) are autocast's; the fused readout
(:mod:`flexgroup.data.fused_readout`, outside autocast) computes the head in the weight's dtype. Under mixed
precision the two differ by about 1e-3 in a log-prob (bfloat16), so each TRL setting gets the readout that
computes what TRL computes.
"""

from __future__ import annotations

__all__ = ["float32_head", "fused_readout"]


def float32_head(trainer) -> bool:
    """TRL's ``cast_lm_head_to_fp32`` under autocast: its head runs in float32 outside autocast, the model's own
    logits are autocast's (bfloat16 / float16)."""
    return bool(getattr(trainer.args, "cast_lm_head_to_fp32", False)) and trainer.accelerator.mixed_precision != "no"


def fused_readout(trainer) -> bool:
    """Whether one-forward text rows read the head with the fused readout: with TRL's float32 head always; under
    autocast without it never (TRL's head is autocast's: the logits readout, exact, with one warning naming the
    fix); else as ``trainer.flexgroup_fused`` asks."""
    if float32_head(trainer):
        return True
    if trainer.flexgroup_fused and trainer.accelerator.mixed_precision != "no":
        trainer._flexgroup_warn("fused-autocast", "flexgroup: flexgroup_fused under mixed precision reads the logits "
                                "instead: TRL's LM head runs under autocast, the fused readout in float32; set "
                                "cast_lm_head_to_fp32=True (TRL's head in float32) to read it fused")
        return False
    return trainer.flexgroup_fused
