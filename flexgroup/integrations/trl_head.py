"""What the TRL GRPO adapter reads of TRL's LM head, so that its log-probs are TRL's own: the readout, and the
temperature.

TRL (``add_fused_lm_head``) computes the head under the trainer's autocast, or in float32 outside it with
``cast_lm_head_to_fp32=True``. The model's own logits (the logits readout) are autocast's; the fused readout
(:mod:`flexgroup.data.fused_readout`, outside autocast) computes the head in the weight's dtype. Under mixed
precision the two differ by about 1e-3 in a log-prob (bfloat16), so each TRL setting gets the readout that
computes what TRL computes.

The temperature is the one TRL divides by: on TRL releases whose ``GRPOTrainer`` adds the fused head, the value
the head was built with (``add_fused_lm_head(temperature=self.temperature)`` in the trainer's constructor, so a
later ``trainer.temperature = x`` changes neither TRL's log-probs nor its generation config); on earlier
releases ``trainer.temperature``, read per call as their ``_get_per_token_logps_and_entropies`` does.
"""

from __future__ import annotations

import sys

from trl import GRPOTrainer

__all__ = ["float32_head", "fused_readout", "temperature"]


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


def temperature(trainer, model) -> float:
    """The temperature TRL divides ``model``'s logits by in ``_get_per_token_logps_and_entropies`` (see the module
    docstring); ``model`` as TRL passes it (wrapped by accelerate or PEFT or not). A TRL that adds the fused head
    but whose head on ``model`` carries no temperature is refused, naming the model, rather than guessed."""
    if not hasattr(sys.modules[GRPOTrainer.__module__], "add_fused_lm_head"):
        return trainer.temperature
    m = trainer.accelerator.unwrap_model(model)
    m = m.get_base_model() if callable(getattr(m, "get_base_model", None)) else m
    f = m.forward
    while f is not None:   # TRL's head, or a wrapper of it (functools.wraps)
        func = getattr(f, "__func__", f)
        code, cells = getattr(func, "__code__", None), getattr(func, "__closure__", None) or ()
        free = dict(zip(code.co_freevars, cells)) if code is not None else {}
        if "temperature" in free and "cast_lm_head_to_fp32" in free:   # the closure of TRL's add_fused_lm_head
            return free["temperature"].cell_contents
        f = getattr(func, "__wrapped__", None)
    raise RuntimeError(f"flexgroup: TRL {sys.modules['trl'].__version__} divides the logits by the temperature its "
                       f"fused LM head (trl add_fused_lm_head) was built with, and {type(m).__name__}.forward is not "
                       "that head; keep the forward TRL's GRPOTrainer gave the model, or use the stock GRPOTrainer")
