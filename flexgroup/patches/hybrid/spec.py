"""Exact grouped forwards for hybrid decoders: state forking for stateful token mixers.

A hybrid decoder interleaves full-attention layers with token mixers that carry state along the
sequence: Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-hybrid) or Mamba2 (Bamba, GraniteMoeHybrid,
NemotronH, Falcon-H1).
Each such mixer is a causal depthwise convolution followed by a chunked recurrent scan; in a packed
row flexgroup forks their state at the segment boundaries of the :class:`~flexgroup.Layout` (the
arithmetic, pure PyTorch, is :mod:`flexgroup.kernels.fork`; its plan is built once per forward and
kept in the carrier with the other per-forward plans). This module is the transformers glue.

Gradients flow through the forked states (no detach, no cache object, nothing updated in place).

How it is wired, without copying transformers' mixer code:

- ``patch`` replaces each mixer's ``forward`` (an instance attribute, a bound method so that deep
  copies stay bound to their own module). On grouped inputs it sets a context variable and calls
  the stock forward with ``cache=None, attention_mask=None``.
- The stock forward reaches the module-level ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``
  / ``mamba2_chunk_scan`` of its modeling module (directly, or through the functions the layer declares
  to transformers' kernel hub with ``@use_kernelized_func``: ``causal_conv1d_forward``,
  ``mamba2_scan_forward``, transformers 5.25); flexgroup installs pass-through wrappers for those names
  in that module. Outside a grouped mixer call they call the original; inside, they split the
  packed row by depth (:mod:`flexgroup.kernels.fork`), call the original (the torch path, or fla / causal-conv1d / mamba-ssm when
  transformers found them) with initial states, and reassemble the packed row. The fused Mamba2
  training shortcut (``mamba2_split_conv1d_scan_combined``) answers ``None`` inside, which makes
  the stock code take its unfused path.
- The layout reaches the mixer through its own ``attention_mask`` argument: a forward pre-hook on
  the language model turns the :class:`GroupedMask` into a ``{layer type: GroupedMask}`` dict, which
  these models pass per layer unchanged. It is an argument of every decoder layer call, so it
  survives gradient-checkpointing recomputation.
- Full-attention layers go through the normal flexgroup attention (AttentionInterface + LayerFacts).

Support is decided by behaviour, never by reading transformers' source: at ``patch`` time each mixer
class runs once, grouped, on a tiny packed row (:mod:`flexgroup.patches.hybrid.probe`), and once more for each other
instance forward one of its mixers carries; it must run the forked conv and scan and equal each sequence run alone
(through that mixer's ungrouped forward), or ``patch`` refuses the model naming what the mixer did. At run
time a mixer whose forward was replaced after ``patch`` (transformers re-kernelizes a loaded model on
every ``train()`` / ``eval()``, which drops instance forwards) is probed again and given flexgroup's forward
back before the next grouped forward (:func:`_retake_forwards`); a grouped mixer call that bypassed a
forked kernel raises, and a grouped forward in which a mixer did not take the grouped path at all (no
grouped mask reached it) raises at the end of the language model's forward (:func:`_mixers_ran_hook`).

With fla / causal-conv1d / mamba-ssm installed, the same padded calls go to their kernels (they take
``initial_state(s)`` of shape ``[N, ...]``); varlen (``cu_seqlens``) packing is not used.
"""

from __future__ import annotations

import contextvars
import sys
import types
from dataclasses import dataclass

import torch

from flexgroup.data.carrier import GroupedMask

from .. import qwen_vl
from .._common import ArchSpec, find_language_model
from .._guards import visual_positions_guard
from .._interface import refuse_cache
from . import attrs
from .discovery import stateful_modules
from .probe import cannot_fork, probe
from .wrappers import ACTIVE, FUNCTIONS, GDN, MAMBA2, WRAPPERS, BypassedFork, Fork, holds_kernels, module_level

__all__ = ["HybridArchSpec", "GDN_SINCE", "no_facts"]

# the oldest transformers the suite forks Gated DeltaNet hybrids on (5.10.4: kernels held as instance attributes,
# flexgroup.patches.hybrid.attrs); Mamba2 hybrids: the spec's default (their 5.10 scans run inline)
GDN_SINCE = "5.10.4"

@dataclass(frozen=True)
class HybridArchSpec(ArchSpec):
    """An :class:`ArchSpec` for decoders with stateful token mixers.

    Attributes (beside ArchSpec's):
        mixers: ``((mixer class name, kind), ...)`` (kind ``GDN`` or ``MAMBA2``): the mixers forked.
        attention: attribute names under which a decoder layer holds its full-attention module
            (``("self_attn",)``; NemotronH: ``("mixer",)``).
        text_config: vision-language models only: the sub-config whose attention is switched
            (``"text_config"``); the decoder is ``model.language_model`` and the vision tower
            ``model.<vision>`` keeps its attention (as in :mod:`flexgroup.patches.qwen_vl`).
        forks_since: the oldest transformers release on which flexgroup is tested to fork these mixers
            (declared support: the test suite fails, never skips, on this release and after; a refusal
            names it when the installed transformers is older).
    """

    mixers: tuple = ()
    forks_since: str = "5.24.0"
    attention: tuple = ("self_attn",)
    text_config: str = ""
    vision: str = "visual"

    def language_model_of(self, base: torch.nn.Module) -> torch.nn.Module:
        return qwen_vl.language_model(base) if self.text_config else find_language_model(base, self.language_model)

    def switch(self, base: torch.nn.Module, name: str) -> None:
        base.set_attn_implementation({self.text_config: name} if self.text_config else name)

    def attention_layers(self, lm: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
        return [(i, a) for i, layer in enumerate(lm.layers) if (a := _attention_of(layer, self)) is not None]

    def layer_facts(self, lm: torch.nn.Module, n: int) -> list[tuple[None, None]]:
        return [(None, None)] * n  # hybrids here have no windows or softcaps on their attention layers

    def watched(self, base: torch.nn.Module) -> object:
        return qwen_vl.vision_tower(base, self).config._attn_implementation if self.text_config else None

    def _mixers(self, lm: torch.nn.Module) -> list[tuple[int, str, torch.nn.Module]]:
        kinds = dict(self.mixers)
        return [(i, name, m) for i, name, m in stateful_modules(lm) if name in kinds]

    def before_switch(self, base: torch.nn.Module, lm: torch.nn.Module) -> None:
        """Refuse stateful mixers flexgroup does not fork; wrap the kernels of those it forks and check, on a
        tiny grouped row per mixer class (:func:`~flexgroup.patches.hybrid.probe.probe`), that they fork exactly."""
        kinds = dict(self.mixers)
        unknown = [(i, name) for i, name, _ in stateful_modules(lm) if name not in kinds]
        if unknown:
            i, name = unknown[0]
            raise ValueError(f"flexgroup.patch: {self.model_type}: layer {i} holds {name}, a stateful token mixer "
                             f"that flexgroup does not fork (it forks {sorted(kinds)}); a packed row would leak its "
                             "state across responses. Run this model without grouping")
        probed = set()
        for _, name, m in self._mixers(lm):
            _install(m, kinds[name], self)
            if (key := (name, _forward_key(m))) not in probed:   # each class, and each instance forward it carries
                probed.add(key)
                if (finding := _probe(m, kinds[name], lm.config.hidden_size)) is not None:
                    raise cannot_fork(self, name, finding)

    def install_extras(self, base: torch.nn.Module, lm: torch.nn.Module) -> list:
        kinds = dict(self.mixers)
        for _, name, m in self._mixers(lm):
            _take_forward(m)
            if holds_kernels(m, kinds[name]):
                attrs.install(m)
        handles = []
        if hasattr(lm, "_update_linear_attn_mask"):  # transformers 5.10-style: the carrier passes unchanged
            attrs.keep_grouped_linear_mask(lm)
        else:  # the language model takes per-layer-type masks (and passes a dict through unchanged)
            handles.append(lm.register_forward_pre_hook(_layer_masks_hook, with_kwargs=True))
        if self._mixers(lm):
            handles.append(lm.register_forward_pre_hook(_start_mixer_record(self), with_kwargs=True))
            handles.append(lm.register_forward_hook(_mixers_ran_hook(self), with_kwargs=True))
        if self.text_config:
            handles.append(qwen_vl.composite_model(base).register_forward_pre_hook(visual_positions_guard, with_kwargs=True))
        return handles

    def remove_extras(self, base: torch.nn.Module, lm: torch.nn.Module) -> None:
        for m in lm.modules():
            if isinstance(m.__dict__.get("forward"), types.MethodType) and m.forward.__func__ is _grouped_mixer_forward:
                _give_back_forward(m)
                attrs.uninstall(m)
        lm.__dict__.pop("_update_linear_attn_mask", None)


def no_facts(config):  # hybrids here have no windows or softcaps on their attention layers (see layer_facts)
    return None


def _install(m: torch.nn.Module, kind: str, spec: HybridArchSpec) -> None:
    """Wrap the module-level kernels of ``m``'s modeling module (idempotent; pass-through when idle), or check
    that ``m`` holds its kernels as instance attributes (wrapped per instance by ``install_extras``); refuse
    (TypeError) a mixer that offers neither. Whether the wrapped kernels are the ones ``m`` runs is decided by
    :func:`_probe`, not here."""
    if holds_kernels(m, kind):
        if attrs.supports(m, kind):
            return
        raise cannot_fork(spec, type(m).__name__, f"its module {type(m).__module__} lacks some of the {kind} "
                          f"functions flexgroup wraps ({list(FUNCTIONS[kind])}) and the mixer holds no kernel "
                          "attributes flexgroup knows")
    module = sys.modules[type(m).__module__]
    for n in module_level(m, kind):
        fn = getattr(module, n)
        if getattr(fn, "_flexgroup_original", None) is None:
            wrapped = WRAPPERS[n](fn)
            wrapped._flexgroup_original = fn
            setattr(module, n, wrapped)


def _probe(m: torch.nn.Module, kind: str, hidden_size: int) -> str | None:
    """:func:`flexgroup.patches.hybrid.probe.probe` of ``m`` through the grouped forward it gets at ``patch``
    (instance kernels wrapped for the probe where ``m`` holds them); None when it forks exactly."""
    held = holds_kernels(m, kind) and "_flexgroup_saved_attrs" not in m.__dict__
    if held:
        attrs.install(m)
    try:
        return probe(m, hidden_size, lambda x, mask: _grouped_mixer_forward(m, x, attention_mask=mask),
                     _stock_forward(m))
    finally:
        if held:
            attrs.uninstall(m)


# ---------------------------------------------------------------------------------- mixer forward
_PREVIOUS = "_flexgroup_previous_forward"


def _take_forward(m: torch.nn.Module) -> None:
    """Make :func:`_grouped_mixer_forward` ``m``'s forward, keeping any instance forward it had (``kernelize``'s)
    for ungrouped calls and for :func:`_give_back_forward`."""
    previous = m.__dict__.get("forward")
    if previous is not None:
        m.__dict__[_PREVIOUS] = previous
    m.forward = types.MethodType(_grouped_mixer_forward, m)


def _give_back_forward(m: torch.nn.Module) -> None:
    del m.forward
    if _PREVIOUS in m.__dict__:
        m.forward = m.__dict__.pop(_PREVIOUS)


def _stock_forward(m: torch.nn.Module):
    """The forward ``m`` runs ungrouped (bound): an instance forward (set by ``kernelize`` or the user; kept aside
    by :func:`_take_forward`, or still in place before it), else its class's."""
    own = m.__dict__.get(_PREVIOUS) or m.__dict__.get("forward")
    if own is not None and getattr(own, "__func__", None) is not _grouped_mixer_forward:
        return own
    return types.MethodType(type(m).forward, m)


def _forward_key(m: torch.nn.Module):
    """The function behind :func:`_stock_forward` of ``m``: mixers of one class running the same one are probed
    once; a mixer given another forward (one layer's replacement) is probed on its own."""
    f = _stock_forward(m)
    return getattr(f, "__func__", f)


_RAN: contextvars.ContextVar = contextvars.ContextVar("flexgroup_hybrid_mixers_ran", default=None)


def _grouped_mixer_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """Replacement ``forward`` of a stateful mixer: forks state on grouped inputs, else the stock forward."""
    if not isinstance(attention_mask, GroupedMask):
        return _stock_forward(self)(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    stock = type(self).forward  # grouped: the class's torch path, whose kernels flexgroup wraps
    where = f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')})"
    for k in ("cache_params", "past_key_values"):
        if kwargs.get(k) is not None:
            cache = kwargs[k]
    if cache is not None:
        refuse_cache(where, "a state cache reached a stateful mixer")
    if hidden_states.shape[0] != 1 or hidden_states.shape[1] != attention_mask.local_tokens:
        raise ValueError(f"{where}: grouped inputs must be one packed row of {attention_mask.local_tokens} tokens "
                         f"(this rank's), got hidden states of shape {tuple(hidden_states.shape)}")
    stream = getattr(attention_mask, "stream", None)  # a chunk of flexgroup.stream_backward: it forks from kept states
    fork = Fork(attention_mask, where) if stream is None else stream.mixer_fork(attention_mask, where, self)
    token = ACTIVE.set(fork)
    try:
        out = stock(self, hidden_states, cache=None, attention_mask=None, **kwargs)
    finally:
        ACTIVE.reset(token)
    ran = getattr(fork, "hits", set())
    if ran != {"conv", "scan"}:  # a stock path that bypassed a forked kernel leaked state across responses
        lost = sorted({"conv", "scan"} - ran)
        raise BypassedFork(f"{where}: the stock forward did not run flexgroup's forked {lost} "
                           "(this transformers version took another code path), so the state would leak across "
                           "responses; please report it with your transformers version", ran)
    if (record := _RAN.get()) is not None:
        record.add(id(self))
    return out


def _start_mixer_record(spec: HybridArchSpec):
    """Forward pre-hook on the language model: a new record of the mixers that took the grouped path; before a
    grouped forward, :func:`_retake_forwards`."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if isinstance(getattr(mask, "mask", mask), GroupedMask):
            _retake_forwards(spec, module)
        _RAN.set(set())  # after the probe's own mixer calls
        return None

    return hook


def _retake_forwards(spec: HybridArchSpec, lm: torch.nn.Module) -> None:
    """Give :func:`_grouped_mixer_forward` back to every mixer whose forward was replaced or removed since
    ``patch``, after checking on a tiny grouped row that it still forks exactly (else the refusal of ``patch``).

    transformers (5.x, with the ``kernels`` package it installs) loads a model with ``use_kernels`` on and
    re-kernelizes it on every ``train()`` / ``eval()`` switch, which drops instance forwards; a copy
    (``copy.deepcopy``) rebinds them to the class's. What the mixer runs now is kept for ungrouped calls."""
    kinds, probed = dict(spec.mixers), set()
    for _, name, m in spec._mixers(lm):
        current = m.__dict__.get("forward")
        if isinstance(current, types.MethodType) and current.__func__ is _grouped_mixer_forward \
                and current.__self__ is m:
            continue
        m.__dict__.pop(_PREVIOUS, None)
        if current is not None and getattr(current, "__func__", None) is _grouped_mixer_forward:
            del m.__dict__["forward"]  # ours, bound to another module (a copy's original): not a stock forward
        _install(m, kinds[name], spec)
        _take_forward(m)
        if holds_kernels(m, kinds[name]) and "_flexgroup_saved_attrs" not in m.__dict__:
            attrs.install(m)
        if (key := (name, _forward_key(m))) not in probed:   # each forward put on a mixer of the class
            probed.add(key)
            if (finding := _probe(m, kinds[name], lm.config.hidden_size)) is not None:
                raise cannot_fork(spec, name, finding)


def _mixers_ran_hook(spec: HybridArchSpec):
    """Forward hook on the language model: after a grouped forward, every mixer of ``spec``'s kinds must have
    taken :func:`_grouped_mixer_forward`'s grouped path; one that did not (its forward replaced after ``patch``,
    or no grouped mask reached it) ran the stock forward over the packed row and leaked state: raise."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output):
        record = _RAN.get()
        _RAN.set(None)
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if not isinstance(getattr(mask, "mask", mask), GroupedMask) or record is None:
            return None
        missed = [(i, m) for i, _, m in spec._mixers(module) if id(m) not in record]
        if missed:
            i, m = missed[0]
            raise RuntimeError(
                f"flexgroup: {len(missed)} stateful mixer(s) of {type(module).__name__}, first {type(m).__name__} at "
                f"layer {i}, did not take flexgroup's grouped path in a grouped forward, so they ran over the packed "
                "row and leaked state across responses: no grouped mask reached them (a decoder layer or hook that "
                "drops or replaces the attention_mask its mixer gets). Call flexgroup.patch(model) last, after "
                "other patches of the decoder layers")
        return None

    return hook


class _EveryLayerType(dict):
    """``{layer type: mask}`` answering the same GroupedMask for every layer type (also ``.get``)."""

    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def __missing__(self, key):
        return self.mask

    def get(self, key, default=None):
        return self.mask

    def __deepcopy__(self, memo):
        return _EveryLayerType(self.mask)


def _layer_masks_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook on the language model: a GroupedMask goes to every layer, stateful ones included."""
    if isinstance(kwargs.get("attention_mask"), GroupedMask):
        kwargs["attention_mask"] = _EveryLayerType(kwargs["attention_mask"])
        return args, kwargs
    if len(args) > 1 and isinstance(args[1], GroupedMask):
        return (args[0], _EveryLayerType(args[1])) + tuple(args[2:]), kwargs
    return None


def _attention_of(layer: torch.nn.Module, spec: HybridArchSpec):
    """The full-attention module of ``layer`` (an ``*Attention`` under one of ``spec.attention``) or None."""
    for attr in spec.attention:
        m = getattr(layer, attr, None)
        if m is not None and "Attention" in type(m).__name__ and type(m).__name__ not in dict(spec.mixers):
            return m
    return None
