"""The attention function flexgroup registers with transformers, and the grouped-mask carrier.

How a packed layout reaches attention: :class:`GroupedMask` is a storage-less tensor of shape
``(1, 1, L, L)`` given to the model as ``attention_mask``. transformers passes a 4-D mask through
unchanged, so our registered attention function receives the object intact and reads its
:class:`~flexgroup.Layout`. Any *other* attention code that touches it (stock sdpa, eager, flash, HF
flex) performs a tensor op on it, and every op raises: an unpatched model given grouped inputs can
never return numbers.

Names: patching registers one attention name per previous implementation,
``flexgroup_<previous>`` (e.g. ``flexgroup_sdpa``), so that ordinary, ungrouped inputs are
delegated to the previous implementation together with the mask that implementation expects.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import patterns as _patterns
from .attention import BACKENDS
from .layout import Layout

__all__ = ["GroupedMask", "LayerFacts", "attention_name", "previous_name", "register", "flexgroup_attention",
           "is_flexgroup_name", "check_grouped_call", "tag_position_ids", "grouped_inputs_hook"]

PREFIX = "flexgroup_"  # registered names: flexgroup_<previous implementation>


class GroupedMask(torch.Tensor):
    """Storage-less ``(1, 1, L, L)`` bool tensor that carries a :class:`Layout` to attention.

    Only flexgroup's attention function reads it (through ``.grouped_layout``); every tensor operation on it
    raises, so attention code that is not flexgroup's cannot silently use it as a causal mask.
    """

    grouped_layout: Layout
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, layout: Layout, device: torch.device | str = "cpu") -> "GroupedMask":
        L = layout.num_tokens
        t = torch.Tensor._make_wrapper_subclass(cls, (1, 1, L, L), dtype=torch.bool, device=torch.device(device))
        t.grouped_layout = layout
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype", torch.bool) == torch.bool:
            # moving the carrier to another device (``{k: v.to(dev)}``) keeps it a carrier
            return GroupedMask(args[0].grouped_layout, kwargs.get("device") or args[0].device)
        raise RuntimeError(
            f"grouped inputs reached attention code that is not flexgroup's ({func}): call "
            "flexgroup.patch(model) first, and do not switch the model's attention implementation "
            "afterwards (flash / sdpa / eager / flex_attention would treat the packed row as one "
            "causal sequence and return wrong numbers)"
        )

    def __repr__(self) -> str:  # the default repr would run tensor ops
        return f"GroupedMask({self.grouped_layout!r}, device={self.device})"

    def __deepcopy__(self, memo):
        return GroupedMask(self.grouped_layout, self.device)

    def __reduce_ex__(self, proto):
        return (GroupedMask, (self.grouped_layout, str(self.device)))


@dataclass
class LayerFacts:
    """What one attention module must compute on grouped inputs (set by ``patch`` on the module).

    ``window``/``softcap`` are the architecture's stated facts; ``from_kwargs=True`` (generic path)
    takes them from the kwargs the module passes instead.
    """

    layer_idx: int | None
    window: int | None = None
    softcap: float | None = None
    from_kwargs: bool = False
    backend: str = "auto"
    previous: str = "sdpa"
    model_type: str = "?"
    max_positions: int | None = None
    _pattern: Any = field(default=None, repr=False)
    _score_mod: Any = field(default=None, repr=False)

    def pattern(self, window: int | None):
        if window is None:
            return None
        if self._pattern is None or self._pattern.window != window:
            self._pattern = _patterns.sliding_window(int(window))
        return self._pattern

    def score_mod(self, cap: float | None):
        if cap is None:
            return None
        if self._score_mod is None or float(self._score_mod.cap) != float(cap):
            self._score_mod = _patterns.softcap(float(cap))
        return self._score_mod


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


def previous_name(name: str) -> str:
    return _NAMES[name]


_NAMES: dict[str, str] = {}


def register(previous: str) -> str:
    """Register ``flexgroup_<previous>`` with AttentionInterface and AttentionMaskInterface; return it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = attention_name(previous)
    AttentionInterface.register(name, flexgroup_attention)
    if previous in ALL_MASK_ATTENTION_FUNCTIONS:
        # ungrouped inputs get exactly the mask the previous implementation would have got
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    else:
        raise ValueError(
            f"flexgroup cannot wrap the attention implementation {previous!r}: transformers has no mask "
            "function for it, so ungrouped inputs could not be delegated exactly. Switch the model to "
            "'sdpa' or 'eager' (model.set_attn_implementation('sdpa')) before flexgroup.patch(model)."
        )
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
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if facts is None:
        raise RuntimeError(f"{where} received grouped inputs but was not prepared by flexgroup.patch(model)")
    if dropout and dropout > 0 and module.training:  # stock code drops only in training mode too
        raise RuntimeError(
            f"{where}: attention dropout {dropout} is active (training mode) and flexgroup cannot "
            "reproduce the baseline's dropout pattern exactly: set config.attention_dropout = 0.0 "
            "(or model.eval())"
        )
    for k in ("cache", "past_key_values", "past_key_value"):
        if kwargs.get(k) is not None:
            raise RuntimeError(f"{where}: a KV cache ({k}) reached attention with grouped inputs; grouped "
                               "forwards are for scoring/training only: pass use_cache=False and no cache")
    B, Hq, Lq, D = query.shape
    L = layout.num_tokens
    if B != 1:
        raise ValueError(f"{where}: grouped inputs must have batch size 1 (one packed row), got {B}")
    if Lq != L or key.shape[-2] != L or value.shape[-2] != L:
        raise RuntimeError(
            f"{where}: query length {Lq} / key length {key.shape[-2]} do not match the grouped layout's "
            f"{L} tokens: a KV cache is in use (use_cache=True or a cache object). Grouped forwards are "
            "for scoring/training only: pass use_cache=False and no cache"
        )
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal", True) is False:
        raise ValueError(f"{where}: bidirectional attention (is_causal=False) cannot take grouped inputs")
    for k in _UNSUPPORTED:
        if kwargs.get(k) is not None:
            raise ValueError(f"{where}: the attention kwarg {k!r} is not supported by flexgroup")
    window, cap = _layer_features(facts, kwargs, where)
    check_grouped_call(layout, facts.max_positions, facts.model_type)

    dev = query.device.type
    if not (query.dtype == key.dtype == value.dtype) and torch.is_autocast_enabled(dev):
        # under autocast q/k can come out of RoPE in float32 while v is in the autocast dtype; stock
        # sdpa runs in the autocast dtype, so do the same
        dt = torch.get_autocast_dtype(dev)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)

    from .attention import attention

    out = attention(
        query, key, value, layout,
        pattern=facts.pattern(window),
        score_mod=facts.score_mod(cap),
        scale=scaling if scaling is not None else D ** -0.5,
        backend=facts.backend,
    )  # [1, Hq, L, D]
    return out.transpose(1, 2).contiguous(), None


def _layer_features(facts: LayerFacts, kwargs: dict, where: str) -> tuple[int | None, float | None]:
    """(window, softcap) for this layer; cross-checks the module's kwargs against the stated facts."""
    kw_window = kwargs.get("sliding_window")
    kw_cap = kwargs.get("softcap")
    if kw_window is not None and (isinstance(kw_window, bool) or int(kw_window) < 1):
        raise ValueError(f"{where}: unexpected sliding_window={kw_window!r}")
    if facts.from_kwargs:
        return (int(kw_window) if kw_window is not None else None,
                float(kw_cap) if kw_cap is not None else None)
    if (kw_window is None) != (facts.window is None) or (kw_window is not None and int(kw_window) != facts.window):
        raise RuntimeError(
            f"{where}: the module passes sliding_window={kw_window!r} but flexgroup's {facts.model_type} "
            f"patch states window={facts.window!r} for this layer. The config or transformers version "
            "differs from what the patch was written for; please report it"
        )
    if (kw_cap is None) != (facts.softcap is None) or (kw_cap is not None and float(kw_cap) != facts.softcap):
        raise RuntimeError(
            f"{where}: the module passes softcap={kw_cap!r} but flexgroup's {facts.model_type} patch states "
            f"softcap={facts.softcap!r} for this layer; please report it"
        )
    return facts.window, facts.softcap


def tag_position_ids(position_ids: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Mark ``position_ids`` as grouped, so a patched model can tell when the GroupedMask is missing."""
    position_ids._flexgroup_layout = layout
    return position_ids


def grouped_inputs_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook on the patched language model: model-level guards for grouped inputs."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    pos = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    tagged = getattr(pos, "_flexgroup_layout", None)
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
            raise ValueError(f"{name}: a KV cache ({k}) cannot be used with grouped inputs: pass {k}=None")
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
    check_grouped_call(layout, getattr(config, "max_position_embeddings", None), config.model_type)
    return None
