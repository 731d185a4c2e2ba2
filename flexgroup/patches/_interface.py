"""transformers glue: the attention function flexgroup registers, per-layer facts, model-level guards.

Names: patching registers one attention name per previous implementation, ``flexgroup_<previous>``
(e.g. ``flexgroup_sdpa``), with transformers' ``AttentionInterface``, so that ordinary, ungrouped
inputs are delegated to the previous implementation together with the mask it expects. Grouped
inputs arrive as a :class:`flexgroup.data.carrier.GroupedMask`; the first layer of a forward builds the
kernel plan (block mask / gather indices) and stores it on the carrier; every later layer only runs
the kernel.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from flexgroup import kernels
from flexgroup.layout import patterns, score_mods
from flexgroup.data.carrier import GroupedMask
from flexgroup.layout.checks import normal_tensors
from flexgroup.kernels import ulysses
from flexgroup.layout import Layout


__all__ = ["LayerFacts", "attention_name", "register", "flexgroup_attention", "is_flexgroup_name",
           "is_flash_style", "CacheNotSupported", "refuse_cache"]

PREFIX = "flexgroup_"  # registered names: flexgroup_<previous implementation>
# attribute of a language model patched with sequence_parallel=group (flexgroup/patches/sequence_parallel.py)
SEQUENCE_PARALLEL = "_flexgroup_sequence_parallel"
_NAMES: dict[str, str] = {}
# one pattern / score_mod object per value, shared by every layer, so that one plan serves them all
@functools.lru_cache(maxsize=128)
@normal_tensors  # kept for the process: never inference tensors
def window_pattern(window: int | None) -> patterns.Pattern | None:
    return None if window is None else patterns.sliding_window(int(window))


@functools.lru_cache(maxsize=128)
@normal_tensors
def softcap_mod(cap: float | None) -> score_mods.ScoreMod | None:
    return None if cap is None else score_mods.softcap(float(cap))


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


def is_flash_style(previous: str, mask_function: Callable | None = None) -> bool:
    """Flash-style implementations: flash_attention_2/3/4, hub kernels (``org/name``) and any name
    whose mask function is transformers' ``flash_attention_mask`` (no 4-D mask reaches the kernel)."""
    name = str(previous).lower()
    return ("flash" in name or "/" in name or "paged" in name
            or getattr(mask_function, "__name__", "") == "flash_attention_mask")


def register(previous: str) -> str:
    """Register ``flexgroup_<previous>`` with AttentionInterface and AttentionMaskInterface; return it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if is_flash_style(previous, ALL_MASK_ATTENTION_FUNCTIONS.get(previous)):
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


class CacheNotSupported(ValueError, RuntimeError):
    """A KV or state cache met grouped inputs (both a ValueError and a RuntimeError, as the refusals were).

    Grouped forwards are for scoring and training only: a cache filled from a packed row holds
    several sequences in one row and is wrong for generation.
    """


def refuse_cache(where: str, what: str, arg: str | None = None) -> None:
    """The one cache refusal of every patch (model hooks, attention function, stateful mixers).

    ``what`` says what happened; ``arg`` names the keyword argument that carried the cache, if any.
    """
    fix = f"drop {arg}= and pass use_cache=False" if arg else "pass use_cache=False and no cache"
    raise CacheNotSupported(
        f"{where}: {what} with grouped inputs: a KV cache or state cache cannot serve a packed row (grouped "
        f"forwards are for scoring and training only): {fix} (batch.model_inputs() does)")


# kwargs that change what attention computes and that flexgroup does not implement
_UNSUPPORTED = ("s_aux", "sinks", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


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
    _check_layer_call(module, facts, attention_mask.local_tokens, query, key, value, dropout, kwargs)
    window, cap = _layer_features(facts, kwargs)
    dev = query.device.type
    if not (query.dtype == key.dtype == value.dtype) and torch.is_autocast_enabled(dev):
        # under autocast q/k can come out of RoPE in float32 while v is in the autocast dtype; stock
        # sdpa runs in the autocast dtype, so do the same
        dt = torch.get_autocast_dtype(dev)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    pat, smod = window_pattern(window), softcap_mod(cap)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    stream = getattr(attention_mask, "stream", None)
    if stream is not None:  # a chunk of flexgroup.stream_backward: also attend to the kept keys and values
        out = stream.attend(module, query, key, value, pat, smod, scale)
        return out.transpose(1, 2).contiguous(), None
    backend = kernels.resolve(facts.backend, dev, kernels.needs_grad(query, key, value))
    plan = attention_mask.plan((backend.name, pat, smod, query.device),
                               lambda: kernels.prepare(layout, pat, smod, query.device, backend))
    if attention_mask.shard is None:
        out = backend.run(plan, query, key, value, scale)  # [1, Hq, L, D]
    else:  # this rank's tokens: all-to-all to head shards around the kernel (flexgroup/kernels/ulysses.py)
        out = ulysses.attention(backend, plan, query, key, value, scale, attention_mask.shard.group, facts.where)
    return out.transpose(1, 2).contiguous(), None


def _check_layer_call(module, facts: LayerFacts, L: int, query, key, value, dropout, kwargs) -> None:
    if dropout and dropout > 0 and module.training:  # stock code drops only in training mode too
        raise RuntimeError(
            f"{facts.where}: attention dropout {dropout} is active (training mode) and flexgroup cannot "
            "reproduce the baseline's dropout pattern exactly: set config.attention_dropout = 0.0 "
            "(or model.eval())"
        )
    for k in ("cache", "past_key_values", "past_key_value"):
        if kwargs.get(k) is not None:
            refuse_cache(facts.where, f"{k}= reached attention", k)
    B, _, Lq, _ = query.shape  # L: the tokens this process computes (all; this rank's slice when sharded)
    if B != 1:
        raise ValueError(f"{facts.where}: grouped inputs must have batch size 1 (one packed row), got {B}")
    if Lq != L or key.shape[-2] != L or value.shape[-2] != L:
        refuse_cache(facts.where, f"query length {Lq} / key length {key.shape[-2]} (not the grouped layout's {L} "
                                  "tokens)")
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
