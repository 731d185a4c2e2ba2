"""Shared machinery of the per-architecture patches: find the language model, prepare its layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from flexgroup.kernels import check_backend_name

from ._interface import LayerFacts

__all__ = ["ArchSpec", "unwrap", "find_language_model", "attention_modules", "layer_types_windows"]


@dataclass(frozen=True)
class ArchSpec:
    """What makes one architecture family special.

    Attributes:
        model_type: ``config.model_type``.
        language_model: attribute of a ``*ForCausalLM`` that holds the decoder (``"model"``); the
            decoder itself is recognised by its ``layers``.
        facts: ``config -> [(window or None, softcap or None)]``, one entry per decoder layer.
        from_kwargs: generic path only -- take window/softcap from the kwargs the module passes.
    """

    model_type: str
    language_model: str
    facts: Callable
    from_kwargs: bool = False


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def find_language_model(model: torch.nn.Module, attr: str) -> torch.nn.Module:
    """The decoder module (has ``.layers``) of ``model`` or of ``model.<attr>``."""
    if isinstance(getattr(model, "layers", None), torch.nn.ModuleList):
        return model
    sub = getattr(model, attr, None)
    if sub is not None and isinstance(getattr(sub, "layers", None), torch.nn.ModuleList):
        return sub
    raise TypeError(
        f"flexgroup.patch: cannot find the language model of {type(model).__name__} (looked for .layers and "
        f".{attr}.layers): transformers may have renamed it; please report it"
    )


def attention_modules(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """``layers[i].self_attn`` for every decoder layer, checked to carry ``layer_idx == i``."""
    mods = []
    for i, layer in enumerate(lm.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            raise TypeError(f"flexgroup.patch: {type(layer).__name__} (layer {i}) has no .self_attn")
        if getattr(attn, "layer_idx", i) != i:
            raise TypeError(f"flexgroup.patch: layers[{i}].self_attn has layer_idx {attn.layer_idx}")
        mods.append(attn)
    return mods


def layer_types_windows(config, softcap: float | None = None) -> list[tuple[int | None, float | None]]:
    """Facts for configs with ``layer_types``: ``sliding_attention`` layers get ``config.sliding_window``."""
    types = list(config.layer_types)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"config.layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    out = []
    for i, t in enumerate(types):
        if t == "sliding_attention":
            # Qwen2/3 set sliding_window=None unless use_sliding_window: the module then passes None
            w = config.sliding_window
            out.append((None if w is None else int(w), softcap))
        elif t == "full_attention":
            out.append((None, softcap))
        else:
            raise ValueError(f"layer {i} has layer type {t!r}, which flexgroup does not know")
    return out


def prepare_layers(lm: torch.nn.Module, spec: ArchSpec, backend: str, previous: str) -> None:
    """Attach :class:`LayerFacts` to every attention module of ``lm``."""
    config = lm.config
    mods = attention_modules(lm)
    facts = [(None, None)] * len(mods) if spec.from_kwargs else spec.facts(config)
    if len(facts) != len(mods):
        raise ValueError(f"{spec.model_type}: {len(facts)} layer facts for {len(mods)} attention modules")
    for i, (m, (w, c)) in enumerate(zip(mods, facts)):
        m._flexgroup = LayerFacts(
            layer_idx=i, window=w, softcap=None if c is None else float(c), from_kwargs=spec.from_kwargs,
            backend=backend, previous=previous, model_type=spec.model_type,
            max_positions=getattr(config, "max_position_embeddings", None), where=f"{type(m).__name__} (layer {i})",
        )


def clear_layers(lm: torch.nn.Module) -> None:
    for m in lm.modules():
        if hasattr(m, "_flexgroup"):
            del m._flexgroup


STATE = "_flexgroup_patch"  # attribute on the language model holding the patch state


def repatch(lm: torch.nn.Module, backend: str) -> bool:
    """If ``lm`` is already patched, only switch its backend (patch is idempotent); True if it was."""
    state = getattr(lm, STATE, None)
    if state is None:
        return False
    state["backend"] = backend
    for m in attention_modules(lm):
        m._flexgroup.backend = backend
    return True


def check_backend(backend: str) -> str:
    """``backend`` if it names a kernels backend (or ``"auto"``), else ValueError listing the choices."""
    try:
        return check_backend_name(backend)
    except ValueError as e:
        raise ValueError(f"flexgroup.patch: {e}") from None
