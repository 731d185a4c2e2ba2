"""Shared machinery of the Qwen vision-language patches (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

Facts common to the family (transformers 5.24 ``modeling_qwen2_vl.py`` / ``_5_vl`` / ``qwen3_vl``):

- ``*ForConditionalGeneration.model`` is a ``*Model`` holding ``.visual`` (vision tower) and
  ``.language_model`` (the text decoder, with ``.layers``). Only the decoder is switched to
  flexgroup, with ``set_attn_implementation({"text_config": name})``; the vision tower keeps its
  own attention (its per-image block-diagonal attention is not a grouped layout).
- Positions are 3-row M-RoPE ids built by :class:`flexgroup.multimodal.MultimodalGroupedBatch`
  from the model's own ``get_rope_index``; the ``*Model`` passes ``position_ids`` to the decoder
  unchanged, so the batch's tag reaches the decoder's forward pre-hook.
- Visual features are scattered into the placeholder tokens of the packed row in order; with the
  packed layout each prompt's images appear once and the vision tower runs once per prompt.
- Guard: grouped inputs whose row holds image/video placeholders but whose ``position_ids`` are
  not 3-row M-RoPE ids (a text ``GroupedBatch``) raise instead of running with 1-D positions.
- Qwen3-VL adds deepstack visual features to the hidden states of the first decoder layers at
  the placeholder positions (``visual_pos_masks``, computed from the packed ``input_ids``): it works
  on the packed row unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexgroup.carrier import GroupedMask

from ._interface import grouped_inputs_hook, is_flexgroup_name, register

from ._common import STATE as _STATE
from ._common import ArchSpec, attention_modules, check_backend, clear_layers, prepare_layers, repatch, unwrap

__all__ = ["VLArchSpec", "language_model", "patch", "unpatch", "is_patched", "no_windows"]


@dataclass(frozen=True)
class VLArchSpec(ArchSpec):
    """An :class:`ArchSpec` whose decoder sits in a composite model.

    Attributes (beside ArchSpec's):
        attn_config: the sub-config whose attention implementation is switched (``"text_config"``).
        vision: attribute of the ``*Model`` that holds the vision tower (left untouched).
    """

    attn_config: str = "text_config"
    vision: str = "visual"


def no_windows(config) -> list[tuple[None, None]]:
    """Facts for decoders without windows or softcaps (Qwen3-VL's text attention passes neither)."""
    return [(None, None)] * int(config.num_hidden_layers)


def _inner(base: torch.nn.Module) -> torch.nn.Module:
    """The ``*Model`` (holding ``.visual`` and ``.language_model``) of ``base``."""
    for m in (base, getattr(base, "model", None)):
        if m is not None and hasattr(m, "language_model") and hasattr(m, "visual"):
            return m
    raise TypeError(f"flexgroup.patch: {type(base).__name__} has no .model.language_model / .model.visual: "
                    "transformers may have renamed them; please report it")


def language_model(base: torch.nn.Module) -> torch.nn.Module:
    """The text decoder (``model.language_model``, has ``.layers``) of a Qwen-VL model."""
    lm = _inner(base).language_model
    if not isinstance(getattr(lm, "layers", None), torch.nn.ModuleList):
        raise TypeError(f"flexgroup.patch: {type(lm).__name__} has no .layers")
    return lm


def vision_tower(base: torch.nn.Module, spec: VLArchSpec) -> torch.nn.Module:
    return getattr(_inner(base), spec.vision)


def is_patched(model: torch.nn.Module) -> bool:
    return getattr(language_model(unwrap(model)), _STATE, None) is not None


def patch(model: torch.nn.Module, spec: VLArchSpec, backend: str = "auto") -> torch.nn.Module:
    """Switch the decoder of a Qwen-VL model to flexgroup (vision tower untouched); returns ``model``.

    Idempotent: patching again only updates ``backend``.
    """
    check_backend(backend)
    base = unwrap(model)
    lm = language_model(base)
    if repatch(lm, backend):
        return model
    sub = getattr(base.config, spec.attn_config)
    if sub is not lm.config:
        raise TypeError(f"flexgroup.patch: {type(lm).__name__}.config is not config.{spec.attn_config}")
    previous = lm.config._attn_implementation or "sdpa"
    if is_flexgroup_name(previous):
        raise RuntimeError(f"{type(lm).__name__} already runs {previous!r} but carries no flexgroup state "
                           "(copied from a patched model?): call flexgroup.unpatch on the original first")
    vision = vision_tower(base, spec)
    vision_impl = vision.config._attn_implementation
    name = register(previous)
    base.set_attn_implementation({spec.attn_config: name})
    stale = sorted({str(m.config._attn_implementation) for m in attention_modules(lm)} - {name})
    if stale or lm.config._attn_implementation != name or vision.config._attn_implementation != vision_impl:
        base.set_attn_implementation({spec.attn_config: previous})
        raise ValueError(
            f"flexgroup.patch: {spec.model_type}: switching {spec.attn_config} to {name!r} left the decoder at "
            f"{stale or lm.config._attn_implementation!r} / the vision tower at "
            f"{vision.config._attn_implementation!r} (was {vision_impl!r}); please report it")
    prepare_layers(lm, spec, backend, previous)
    handle = lm.register_forward_pre_hook(grouped_inputs_hook, with_kwargs=True)
    guard = _inner(base).register_forward_pre_hook(_visual_positions_guard, with_kwargs=True)
    setattr(lm, _STATE, {"previous": previous, "name": name, "hook_id": handle.id, "backend": backend,
                         "model_type": spec.model_type, "guard": guard})
    return model


def _visual_positions_guard(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Grouped inputs with visual placeholders need 3-row M-RoPE ids (a MultimodalGroupedBatch)."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if not isinstance(mask, GroupedMask):
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    pos = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    cfg = module.config
    visual = ids is not None and bool(((ids == cfg.image_token_id) | (ids == cfg.video_token_id)).any())
    if visual and (pos is None or pos.ndim != 3 or pos.shape[0] != 3):
        raise ValueError(
            f"{type(module).__name__} got grouped inputs with image/video placeholders but position_ids of shape "
            f"{None if pos is None else tuple(pos.shape)}: visual tokens need 3-row M-RoPE ids. Build the batch "
            "with flexgroup.multimodal.MultimodalGroupedBatch.from_groups(..., model=model, vision=...)")
    return None


def unpatch(model: torch.nn.Module, spec: VLArchSpec) -> torch.nn.Module:
    """Restore the decoder's previous attention implementation; returns ``model``."""
    base = unwrap(model)
    lm = language_model(base)
    state = getattr(lm, _STATE, None)
    if state is None:
        return model
    base.set_attn_implementation({spec.attn_config: state["previous"]})
    lm._forward_pre_hooks.pop(state["hook_id"], None)
    lm._forward_pre_hooks_with_kwargs.pop(state["hook_id"], None)
    state["guard"].remove()
    clear_layers(lm)
    delattr(lm, _STATE)
    return model
