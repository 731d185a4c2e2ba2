"""Shared machinery of the Qwen vision-language patches (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

Facts common to the family (transformers 5.24 ``modeling_qwen2_vl.py`` / ``_5_vl`` / ``qwen3_vl``):

- ``*ForConditionalGeneration.model`` is a ``*Model`` holding ``.visual`` (vision tower) and
  ``.language_model`` (the text decoder, with ``.layers``). Only the decoder is switched to
  flexgroup, with ``set_attn_implementation({"text_config": name})``; the vision tower keeps its
  own attention (its per-image block-diagonal attention is not a grouped layout).
- Positions are 3-row M-RoPE ids built by :class:`flexgroup.data.multimodal.MultimodalGroupedBatch`
  from the model's own ``get_rope_index``; the ``*Model`` passes ``position_ids`` to the decoder
  unchanged, so the batch's tag reaches the decoder's forward pre-hook.
- Visual features are scattered into the placeholder tokens of the packed row in order; with the
  packed layout each prompt's images appear once and the vision tower runs once per prompt.
- Guard (:func:`flexgroup.patches._guards.visual_positions_guard`): grouped inputs whose row holds
  image/video placeholders but whose ``position_ids`` are not 3-row M-RoPE ids (a text
  ``GroupedBatch``) raise instead of running with 1-D positions.
- Qwen3-VL adds deepstack visual features to the hidden states of the first decoder layers at
  the placeholder positions (``visual_pos_masks``, computed from the packed ``input_ids``): it works
  on the packed row unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import ArchSpec
from ._guards import visual_positions_guard

__all__ = ["VLArchSpec", "language_model", "composite_model", "vision_tower", "no_windows"]


@dataclass(frozen=True)
class VLArchSpec(ArchSpec):
    """An :class:`ArchSpec` whose decoder sits in a composite model.

    Attributes (beside ArchSpec's):
        attn_config: the sub-config whose attention implementation is switched (``"text_config"``).
        vision: attribute of the ``*Model`` that holds the vision tower (left untouched).
    """

    attn_config: str = "text_config"
    vision: str = "visual"

    def language_model_of(self, base: torch.nn.Module) -> torch.nn.Module:
        return language_model(base)

    def switch(self, base: torch.nn.Module, name: str) -> None:
        base.set_attn_implementation({self.attn_config: name})

    def before_switch(self, base: torch.nn.Module, lm: torch.nn.Module) -> None:
        if getattr(base.config, self.attn_config) is not lm.config:
            raise TypeError(f"flexgroup.patch: {type(lm).__name__}.config is not config.{self.attn_config}")

    def watched(self, base: torch.nn.Module) -> object:
        return vision_tower(base, self).config._attn_implementation

    def install_extras(self, base: torch.nn.Module, lm: torch.nn.Module) -> list:
        return [composite_model(base).register_forward_pre_hook(visual_positions_guard, with_kwargs=True)]


def no_windows(config) -> list[tuple[None, None]]:
    """Facts for decoders without windows or softcaps (Qwen3-VL's text attention passes neither)."""
    return [(None, None)] * int(config.num_hidden_layers)


def composite_model(base: torch.nn.Module) -> torch.nn.Module:
    """The ``*Model`` (holding ``.visual`` and ``.language_model``) of ``base``."""
    for m in (base, getattr(base, "model", None)):
        if m is not None and hasattr(m, "language_model") and hasattr(m, "visual"):
            return m
    raise TypeError(f"flexgroup.patch: {type(base).__name__} has no .model.language_model / .model.visual: "
                    "transformers may have renamed them; please report it")


def language_model(base: torch.nn.Module) -> torch.nn.Module:
    """The text decoder (``model.language_model``, has ``.layers``) of a Qwen-VL model."""
    lm = composite_model(base).language_model
    if not isinstance(getattr(lm, "layers", None), torch.nn.ModuleList):
        raise TypeError(f"flexgroup.patch: {type(lm).__name__} has no .layers")
    return lm


def vision_tower(base: torch.nn.Module, spec: VLArchSpec) -> torch.nn.Module:
    return getattr(composite_model(base), spec.vision)
