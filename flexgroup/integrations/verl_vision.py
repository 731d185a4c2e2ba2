"""verl's vision-language micro-batches (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) as one :class:`MultimodalGroupedBatch`.

What verl 0.9 hands its engine for a Qwen-VL model (``verl/experimental/agent_loop/agent_loop.py``,
``verl/workers/utils/padding.py``): jagged ``input_ids`` ``[N, n_i]`` (placeholders expanded), jagged
``position_ids`` ``[N, 4, n_i]`` -- row 0 the text positions ``0..n_i-1``, rows 1-3 the model's M-RoPE ids of
the whole sequence (its own ``get_rope_index``) -- and ``multi_modal_inputs``: one mapping per sample
(``pixel_values`` [patches_i, D], ``image_grid_thw`` [n_img, 3], videos likewise), every sample carrying its
own copy of its prompt's images. verl's stock step concatenates them, so the vision tower encodes each
image once per response.

Here the samples become one :meth:`MultimodalGroupedBatch.from_sequences` tree: a placeholder is shared only
where the pixels are equal, so each distinct image of the micro-batch is encoded once and each prompt once.
The batch's own M-RoPE ids (the model's ``get_rope_index``) must equal verl's rows 1-3 on every sample,
and row 0 must count ``0..n_i-1``: else :func:`multimodal_batch` raises ValueError and the engine runs verl's
stock step (one warning). The model receives ``[virtual positions; M-RoPE]`` ``[4, 1, L]``: verl's patched
Qwen-VL forwards require four rows, and transformers passes row 0 to the decoder layers.

verl's ``use_remove_padding`` replaces the decoder attention of Qwen2-VL / Qwen2.5-VL with a flash-attention
forward at class level (``qwen2_vl_attn_forward``); :func:`restore_attention` gives the engine's own model
back transformers' forward (recorded when this module is imported, before verl builds a model), per module
instance, so flexgroup's attention is reached and other engines keep verl's.

Used by :mod:`flexgroup.integrations.verl`; nothing here is TRL-specific or verl-version-specific beyond the
layout above.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from flexgroup.data.carrier import tag_position_ids
from flexgroup.data.mrope import VISION_KEYS, MRopeIndex, normalize_vision, visual_item_keys
from flexgroup.data.multimodal import MultimodalGroupedBatch

__all__ = ["VL_MODEL_TYPES", "vision_reason", "sample_vision", "multimodal_batch", "vl_model_inputs",
           "plan_sequences", "restore_attention", "is_vision_batch", "vision_patches"]

Tensor = torch.Tensor
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
_ACCEPTED = set(VISION_KEYS) | {"mm_token_type_ids"}


def _attention_classes() -> dict[type, Any]:
    """transformers' own decoder-attention forwards that verl replaces with ``use_remove_padding``."""
    out = {}
    try:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLAttention
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLAttention
    except ImportError:  # pragma: no cover - transformers without these models
        return out
    for cls in (Qwen2VLAttention, Qwen2_5_VLAttention):
        if cls.forward.__module__.startswith("transformers."):
            out[cls] = cls.forward
    return out


_ORIGINAL_ATTENTION = _attention_classes()


def is_vision_batch(mb) -> bool:
    """True when verl's micro-batch carries visual inputs or 3-D (M-RoPE) position ids."""
    pos = mb["position_ids"] if "position_ids" in mb.keys() else None
    if pos is not None and pos.dim() == 3:
        return True
    return any(v for v in sample_vision(mb)) if "multi_modal_inputs" in mb.keys() else False


def sample_vision(mb) -> list[dict | None]:
    """verl's ``multi_modal_inputs``: one mapping (or None) per sample, tensors as given."""
    if "multi_modal_inputs" not in mb.keys():
        return [None] * len(mb)
    raw = mb.get("multi_modal_inputs")
    items = raw.tolist() if hasattr(raw, "tolist") else list(raw)
    out = []
    for x in items:
        x = getattr(x, "data", x)
        out.append({k: v for k, v in dict(x).items() if v is not None} if x else None)
    return out


def vision_reason(model, mb, sequence_parallel: bool) -> str | None:
    """Why a vision-language micro-batch cannot be grouped, or None (checked before :func:`multimodal_batch`)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in VL_MODEL_TYPES:
        return (f"multimodal inputs or 3-D (M-RoPE) position ids on model_type={model_type!r} (grouped vision-language "
                f"forwards: {', '.join(VL_MODEL_TYPES)})")
    if sequence_parallel:
        return ("multimodal inputs under Ulysses sequence parallelism (not wired to flexgroup's sharded "
                "vision-language batch)")
    pos = mb["position_ids"]
    if not getattr(pos, "is_nested", False) or pos.dim() != 3 or pos.values().shape[0] != 4:
        return (f"vision-language position_ids of shape {tuple(pos.shape) if not pos.is_nested else 'nested'} "
                "(expected verl's jagged [N, 4, n_i]: text positions, then 3 M-RoPE rows)")
    for i, v in enumerate(sample_vision(mb)):
        unknown = sorted(set(v or {}) - _ACCEPTED)
        if unknown:
            return f"multi_modal_inputs keys {unknown} (sample {i}; grouped: {sorted(_ACCEPTED)})"
    return None


def multimodal_batch(mb, model) -> MultimodalGroupedBatch:
    """The micro-batch's samples as one vision-language prefix tree; ``paths[i]`` is sample ``i``'s tokens.

    ValueError (the engine then runs verl's stock step) when a sample's visual inputs do not fill its
    placeholders, or when the batch's M-RoPE ids differ from verl's ``position_ids`` rows 1-3 on any sample
    (or row 0 does not count ``0..n_i-1``).
    """
    ids, pos = mb["input_ids"], mb["position_ids"]
    lens = ids.offsets().diff().cpu().tolist()
    seqs = list(ids.values().cpu().split(lens))
    vision = [{k: x for k, x in v.items() if k != "mm_token_type_ids"} if v else None for v in sample_vision(mb)]
    batch = MultimodalGroupedBatch.from_sequences(seqs, model=model, vision=vision)
    given = pos.values().cpu()                                         # [4, T], samples one after another
    mine = batch.mrope_position_ids[:, torch.cat(batch.paths)]        # [3, T]
    text = torch.cat([torch.arange(n) for n in lens])
    if not torch.equal(given[1:], mine) or not torch.equal(given[0], text):
        bad = int(((given[1:] != mine).any(0) | (given[0] != text)).nonzero()[0, 0])
        sample = int(torch.searchsorted(torch.tensor(lens).cumsum(0), bad, right=True))
        raise ValueError(f"position_ids that are not the model's own M-RoPE index (sample {sample}, "
                         f"model_type={batch.rope.model_type})")
    return batch


def vl_model_inputs(batch: MultimodalGroupedBatch, device) -> dict:
    """``batch.model_inputs(device)`` with ``position_ids`` ``[4, 1, L]``: the virtual positions, then M-RoPE
    (verl's patched Qwen-VL forwards take four rows; tagged like the batch's own)."""
    out = batch.model_inputs(device)
    mrope = out["position_ids"]                                        # [3, 1, L]
    virtual = batch.layout.position_ids.to(mrope.device)[None, None]   # [1, 1, L]
    out["position_ids"] = tag_position_ids(torch.cat([virtual, mrope]), batch.layout)
    return out


def plan_sequences(data, model) -> list[list[int]]:
    """Per sample, its token ids with each visual placeholder replaced by a key of its item's pixels (a
    negative int, equal only for equal pixels): what the planner's prefix trie must share."""
    ids = data["input_ids"]
    lens = ids.offsets().diff().cpu().tolist()
    seqs = list(ids.values().cpu().split(lens))
    rope = MRopeIndex.from_model(model)
    kept = [normalize_vision({k: x for k, x in v.items() if k != "mm_token_type_ids"} if v else None, i, s, rope,
                             "sequence") for i, (s, v) in enumerate(zip(seqs, sample_vision(data)))]
    keys, _, _ = visual_item_keys(seqs, kept, rope)
    names: dict[tuple, int] = {}
    return [[t if isinstance(t, int) else -1 - names.setdefault(t, len(names)) for t in key] for key in keys]


def restore_attention(model: torch.nn.Module) -> None:
    """Give each decoder attention module of ``model`` transformers' own forward where verl replaced it at
    class level (``use_remove_padding``: a flash-attention forward that takes no mask). RuntimeError if
    verl's replacement was installed before this module was imported (transformers' forward then unknown)."""
    names = ("Qwen2VLAttention", "Qwen2_5_VLAttention")
    for m in model.modules():
        base = next((c for c in type(m).__mro__ if c.__name__ in names), None)  # FSDP may subclass the module
        if base is None:
            continue
        if base in _ORIGINAL_ATTENTION:
            if type(m).forward is not _ORIGINAL_ATTENTION[base]:
                m.forward = types.MethodType(_ORIGINAL_ATTENTION[base], m)
        elif not base.forward.__module__.startswith("transformers."):
            raise RuntimeError(
                f"flexgroup: {base.__name__}.forward was replaced ({base.forward.__module__}: verl's use_remove_padding "
                "attention) before flexgroup.integrations.verl was imported, so transformers' own forward is unknown. "
                "Import it first (actor_rollout_ref.model.external_lib=flexgroup.integrations.verl does).")


def vision_patches(mb) -> int:
    """Patch rows the vision tower encodes for verl's stock step of ``mb`` (every sample's own copies)."""
    return sum(int(v[k].shape[0]) for v in sample_vision(mb) if v for k in ("pixel_values", "pixel_values_videos")
               if k in v)
