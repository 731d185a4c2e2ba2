"""transformers glue: the attention function flexgroup registers, per-layer facts, model-level guards.

Names: patching registers one attention name per previous implementation, ``flexgroup_<previous>``
(e.g. ``flexgroup_sdpa``), with transformers' ``AttentionInterface``, so that ordinary, ungrouped
inputs are delegated to the previous implementation together with the mask it expects. Grouped
inputs arrive as a :class:`flexgroup.carrier.GroupedMask`; the first layer of a forward builds the
kernel plan (block mask / gather indices) and stores it on the carrier; every later layer only runs
the kernel.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from flexgroup import kernels, patterns
from flexgroup.carrier import GroupedMask, tagged_layout
from flexgroup.layout import Layout

from ._guards import CARRIER, guards_of

__all__ = ["LayerFacts", "attention_name", "register", "flexgroup_attention", "is_flexgroup_name",
           "check_grouped_call", "grouped_inputs_hook"]

PREFIX = "flexgroup_"  # registered names: flexgroup_<previous implementation>
_NAMES: dict[str, str] = {}
# one pattern / score_mod object per value, shared by every layer, so that one plan serves them all
@functools.lru_cache(maxsize=None)
def window_pattern(window: int | None) -> patterns.Pattern | None:
    return None if window is None else patterns.sliding_window(int(window))


@functools.lru_cache(maxsize=None)
def softcap_mod(cap: float | None) -> patterns.ScoreMod | None:
    return None if cap is None else patterns.softcap(float(cap))


@dataclass
class LayerFacts:
    """What one attention module must compute on grouped inputs (set by ``patch`` on the module).

    ``window``/``softcap`` are the architecture's stated facts; ``from_kwargs=True`` (generic path)
    takes them from the kwargs the module passes instead. ``where`` names the module in errors.
    """

    layer_idx: int | None
    window: int | None = None
    softcap: float | None = None
    from_kwargs: bool = False
    backend: str = "auto"
    previous: str = "sdpa"
    model_type: str = "?"
    max_positions: int | None = None
    where: str = "attention"


def _sanitize(prev: str) -> str:
    # transformers runs capability checks on names containing "flash" or "flex_attention"
    return prev.replace("flash_attention", "fa").replace("flex_attention", "fx").replace("flash", "fa")


def attention_name(previous: str) -> str:
    """The registered name that runs flexgroup on grouped inputs and ``previous`` otherwise."""
    name = PREFIX + _sanitize(previous)
    _NAMES[name] = previous
    return name


def is_flexgroup_name(name) -> bool:
    return isinstance(name, str) and name in _NAMES


def _is_flash(previous: str, mask_function: Callable | None) -> bool:
    """Flash-style implementations: flash_attention_2/3/4, hub kernels (``org/name``) and any name
    whose mask function is transformers' ``flash_attention_mask`` (no 4-D mask reaches the kernel)."""
    name = str(previous).lower()
    return ("flash" in name or "/" in name or "paged" in name
            or getattr(mask_function, "__name__", "") == "flash_attention_mask")


def register(previous: str) -> str:
    """Register ``flexgroup_<previous>`` with AttentionInterface and AttentionMaskInterface; return it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if _is_flash(previous, ALL_MASK_ATTENTION_FUNCTIONS.get(previous)):
        raise ValueError(
            f"the model runs attn_implementation={previous!r}: flash-attention kernels take no custom "
            "mask (the packed row would be one causal sequence) and transformers' flash path cannot be "
            "delegated to under another name, so flexgroup refuses it. Load the model with "
            "attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa')) before "
            "flexgroup.patch(model): grouped inputs then run flexgroup's kernel, ordinary inputs sdpa."
        )
    if previous not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"flexgroup cannot wrap the attention implementation {previous!r}: transformers has no mask "
            "function for it, so ungrouped inputs could not be delegated exactly. Switch the model to "
            "'sdpa' or 'eager' (model.set_attn_implementation('sdpa')) before flexgroup.patch(model)."
        )
    name = attention_name(previous)
    AttentionInterface.register(name, flexgroup_attention)
    # ungrouped inputs get exactly the mask the previous implementation would have got
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    return name


def _previous_function(module, previous: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if previous == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"{type(module).__name__}: no eager_attention_forward in {type(module).__module__}")
        return fn
    return ALL_ATTENTION_FUNCTIONS[previous]


# kwargs that change what attention computes and that flexgroup does not implement
_UNSUPPORTED = ("s_aux", "sinks", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def check_grouped_call(layout: Layout, max_positions: int | None, model_type: str) -> None:
    if max_positions is not None and layout.max_position >= max_positions:
        raise ValueError(
            f"grouped inputs reach virtual position {layout.max_position}, but the {model_type} model "
            f"supports positions < {max_positions} (config.max_position_embeddings): shorten the prompt "
            "or responses, or split the batch"
        )


def flexgroup_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """Attention function registered with transformers' AttentionInterface.

    Args:
        query: [B, Hq, L, D], RoPE applied. key/value: [B, Hkv, L, D].
        attention_mask: a :class:`GroupedMask` (grouped inputs, ``B == 1``) or whatever the previous
            implementation's mask function produced (ordinary inputs, delegated unchanged).

    Returns:
        (out [B, L, Hq, D], None)
    """
    facts: LayerFacts | None = getattr(module, "_flexgroup", None)
    if not isinstance(attention_mask, GroupedMask):
        if facts is None:
            raise RuntimeError(
                f"{type(module).__name__} runs flexgroup's attention but was not prepared by "
                "flexgroup.patch(model): call flexgroup.patch on the model that owns it"
            )
        fn = _previous_function(module, facts.previous)
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    layout = attention_mask.grouped_layout
    if facts is None:
        raise RuntimeError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) received grouped "
                           "inputs but was not prepared by flexgroup.patch(model)")
    _check_layer_call(module, facts, layout, query, key, value, dropout, kwargs)
    window, cap = _layer_features(facts, kwargs)
    dev = query.device.type
    if not (query.dtype == key.dtype == value.dtype) and torch.is_autocast_enabled(dev):
        # under autocast q/k can come out of RoPE in float32 while v is in the autocast dtype; stock
        # sdpa runs in the autocast dtype, so do the same
        dt = torch.get_autocast_dtype(dev)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    backend = kernels.resolve(facts.backend, dev, kernels.needs_grad(query, key, value))
    pat, smod = window_pattern(window), softcap_mod(cap)
    plan = attention_mask.plan((backend.name, pat, smod, query.device),
                               lambda: kernels.prepare(layout, pat, smod, query.device, backend))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = backend.run(plan, query, key, value, scale)  # [1, Hq, L, D]
    return out.transpose(1, 2).contiguous(), None


def _check_layer_call(module, facts: LayerFacts, layout: Layout, query, key, value, dropout, kwargs) -> None:
    if dropout and dropout > 0 and module.training:  # stock code drops only in training mode too
        raise RuntimeError(
            f"{facts.where}: attention dropout {dropout} is active (training mode) and flexgroup cannot "
            "reproduce the baseline's dropout pattern exactly: set config.attention_dropout = 0.0 "
            "(or model.eval())"
        )
    for k in ("cache", "past_key_values", "past_key_value"):
        if kwargs.get(k) is not None:
            raise RuntimeError(f"{facts.where}: a KV cache ({k}) reached attention with grouped inputs; grouped "
                               "forwards are for scoring/training only: pass use_cache=False and no cache")
    B, _, Lq, _ = query.shape
    L = layout.num_tokens
    if B != 1:
        raise ValueError(f"{facts.where}: grouped inputs must have batch size 1 (one packed row), got {B}")
    if Lq != L or key.shape[-2] != L or value.shape[-2] != L:
        raise RuntimeError(
            f"{facts.where}: query length {Lq} / key length {key.shape[-2]} do not match the grouped layout's "
            f"{L} tokens: a KV cache is in use (use_cache=True or a cache object). Grouped forwards are "
            "for scoring/training only: pass use_cache=False and no cache"
        )
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal", True) is False:
        raise ValueError(f"{facts.where}: bidirectional attention (is_causal=False) cannot take grouped inputs")
    for k in _UNSUPPORTED:
        if kwargs.get(k) is not None:
            raise ValueError(f"{facts.where}: the attention kwarg {k!r} is not supported by flexgroup")


def _layer_features(facts: LayerFacts, kwargs: dict) -> tuple[int | None, float | None]:
    """(window, softcap) for this layer; cross-checks the module's kwargs against the stated facts."""
    kw_window = kwargs.get("sliding_window")
    kw_cap = kwargs.get("softcap")
    if kw_window is not None and (isinstance(kw_window, bool) or int(kw_window) < 1):
        raise ValueError(f"{facts.where}: unexpected sliding_window={kw_window!r}")
    if facts.from_kwargs:
        return (int(kw_window) if kw_window is not None else None,
                float(kw_cap) if kw_cap is not None else None)
    if (kw_window is None) != (facts.window is None) or (kw_window is not None and int(kw_window) != facts.window):
        raise RuntimeError(
            f"{facts.where}: the module passes sliding_window={kw_window!r} but flexgroup's {facts.model_type} "
            f"patch states window={facts.window!r} for this layer. The config or transformers version "
            "differs from what the patch was written for; please report it"
        )
    if (kw_cap is None) != (facts.softcap is None) or (kw_cap is not None and float(kw_cap) != facts.softcap):
        raise RuntimeError(
            f"{facts.where}: the module passes softcap={kw_cap!r} but flexgroup's {facts.model_type} patch states "
            f"softcap={facts.softcap!r} for this layer; please report it"
        )
    return facts.window, facts.softcap


def grouped_inputs_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook on the patched language model: model-level guards for grouped inputs.

    Runs the checks of :mod:`flexgroup.patches._guards` (position-dependent RoPE scaling, Llama-4
    temperature tuning, dropout) once per forward, puts back the grouped mask that the causal-LM
    wrapper's hook carried through the MoE aux-loss weights, and starts a new forward on the carrier
    (its plans are rebuilt once, then shared by the layers).
    """
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    carried = getattr(mask, CARRIER, None)  # MoE aux-loss weights from the causal-LM wrapper's hook
    if carried is not None:
        mask = carried
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = mask
        else:
            args = args[:1] + (mask,) + args[2:]
    pos = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    tagged = tagged_layout(pos)
    config = module.config
    name = type(module).__name__
    if not isinstance(mask, GroupedMask):
        if tagged is not None:
            raise ValueError(
                f"{name} got grouped position_ids (from GroupedBatch.model_inputs) with attention_mask of type "
                f"{type(mask).__name__}: a user attention_mask replaces the grouped layout and would give wrong "
                "numbers. Pass batch.model_inputs() unchanged (its attention_mask carries the layout)"
            )
        return None
    layout = mask.grouped_layout
    impl = getattr(config, "_attn_implementation", None)
    if not is_flexgroup_name(impl):
        raise RuntimeError(
            f"{name} got grouped inputs but its attention implementation is {impl!r}, not flexgroup's: "
            "flash / sdpa / eager kernels ignore the grouped layout. Call flexgroup.patch(model) again "
            "after switching implementations"
        )
    for k in ("cache", "past_key_values"):
        if kwargs.get(k) is not None:
            raise ValueError(f"{name}: a KV cache was passed as {k}= with grouped inputs: grouped forwards are for "
                             f"scoring and training only; pass {k}=None")
    use_cache = kwargs.get("use_cache")
    if use_cache or (use_cache is None and getattr(config, "use_cache", False)):
        raise ValueError(f"{name}: use_cache={use_cache!r} with grouped inputs: a cache filled from a packed "
                         "row is wrong for generation; pass use_cache=False (batch.model_inputs() does)")
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if ids is not None and (ids.shape[0] != 1 or ids.shape[1] != layout.num_tokens):
        raise ValueError(f"{name}: grouped inputs must be one packed row of {layout.num_tokens} tokens, got "
                         f"input of shape {tuple(ids.shape)}")
    if pos is None:
        raise ValueError(f"{name}: grouped inputs need their virtual position_ids (batch.model_inputs() gives "
                         "them); without them RoPE would use physical positions")
    if tagged is not layout:
        if pos.shape[-1] != layout.num_tokens or not torch.equal(pos.reshape(-1, pos.shape[-1])[0].cpu(),
                                                                 layout.position_ids):
            raise ValueError(f"{name}: position_ids do not match the grouped layout's virtual positions")
    guards = guards_of(module)
    guards.check(layout, name, mask.sequence_ends)
    guards.check_dropout(module, None, name)
    check_grouped_call(layout, getattr(config, "max_position_embeddings", None), config.model_type)
    mask.new_forward()
    return (args, kwargs) if carried is not None else None
