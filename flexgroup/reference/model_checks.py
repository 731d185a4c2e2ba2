"""Checks of the model an entry point is given: the one PEFT unwrap and the refusal of meta (shape-only) weights.

They sit in the reference layer, the lowest that runs a model (each sequence alone), so that every layer that
takes a model -- the data layer's M-RoPE facts, the patches, scoring, streaming, verify -- uses the same two
rules. Pure PyTorch, no transformers, no peft import (a PEFT wrapper is recognised by ``get_base_model``).
"""

from __future__ import annotations

import torch

__all__ = ["unwrap", "check_materialized"]


def unwrap(model):
    """The model inside a PEFT wrapper (``get_base_model()``), or ``model`` itself: the one PEFT unwrap."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def check_materialized(model: torch.nn.Module, where: str) -> None:
    """ValueError naming the first parameter or buffer of ``model`` on the meta device (shapes, no data): a
    meta model runs every forward and only fails when a result is read, so entry points that read results
    (streaming, scoring, verify) refuse it up front."""
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        name = next((n for n, t in items if t.is_meta), None)
        if name is not None:
            raise ValueError(f"{where}: the model is on the meta device ({kind} {name!r} has a shape but no data), "
                             "so it has no log-probs to give: load real weights first -- from_pretrained(...), or "
                             "model.load_state_dict(state_dict, assign=True) into a model built under accelerate's "
                             "init_empty_weights() (its buffers, e.g. RoPE's inv_freq, stay real: a state dict does not "
                             "hold them, and after model.to_empty(device=...) they are uninitialised memory)")
