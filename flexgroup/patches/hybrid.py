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
- The stock forward calls its module-level ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``
  / ``mamba2_chunk_scan``; flexgroup installs pass-through wrappers for those names in the mixer's
  modeling module. Outside a grouped mixer call they call the original; inside, they split the
  packed row by depth (:mod:`flexgroup.kernels.fork`), call the original (the torch path, or fla / causal-conv1d / mamba-ssm when
  transformers found them) with initial states, and reassemble the packed row. The fused Mamba2
  training shortcut (``mamba2_split_conv1d_scan_combined``) answers ``None`` inside, which makes
  the stock code take its unfused path.
- The layout reaches the mixer through its own ``attention_mask`` argument: a forward pre-hook on
  the language model turns the :class:`GroupedMask` into a ``{layer type: GroupedMask}`` dict, which
  these models pass per layer unchanged. It is an argument of every decoder layer call, so it
  survives gradient-checkpointing recomputation.
- Full-attention layers go through the normal flexgroup attention (AttentionInterface + LayerFacts).

GPU note: with fla / causal-conv1d / mamba-ssm installed, the same padded calls go to their
kernels (they take ``initial_state(s)`` of shape ``[N, ...]``); varlen (``cu_seqlens``) packing is
not used. That path is untested here (no GPU, kernels not installed).
"""

from __future__ import annotations

import contextvars
import inspect
import sys
import types
from dataclasses import dataclass

import torch

from flexgroup.data.carrier import GroupedMask
from flexgroup.kernels.fork import ForkPlan, ForkStates, fork_plan, forked_conv, forked_gated_delta, forked_mamba2_scan

from . import qwen_vl
from ._common import ArchSpec, find_language_model, is_patched_with, patch_with, unpatch_with
from ._guards import visual_positions_guard
from ._interface import refuse_cache
from .hybrid_discovery import stateful_modules

__all__ = ["HybridArchSpec", "patch", "unpatch", "is_patched", "fork_plan", "ForkPlan", "stateful_modules",
           "GDN", "MAMBA2", "active_mask"]

# mixer kind -> the module-level functions its stock forward calls (all must be present)
GDN = "gated_deltanet"
MAMBA2 = "mamba2"
_FUNCTIONS = {
    GDN: ("causal_conv1d_fn", "torch_chunk_gated_delta_rule"),
    MAMBA2: ("causal_conv1d_fn", "mamba2_chunk_scan", "mamba2_split_conv1d_scan_combined"),
}


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
    """

    mixers: tuple = ()
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
        """Refuse stateful mixers flexgroup does not fork; wrap the kernels of those it forks."""
        kinds = dict(self.mixers)
        unknown = [(i, name) for i, name, _ in stateful_modules(lm) if name not in kinds]
        if unknown:
            i, name = unknown[0]
            raise ValueError(f"flexgroup.patch: {self.model_type}: layer {i} holds {name}, a stateful token mixer "
                             f"that flexgroup does not fork (it forks {sorted(kinds)}); a packed row would leak its "
                             "state across responses. Run this model without grouping")
        for _, name, m in self._mixers(lm):
            _install(m, kinds[name], self.model_type)
        if self._mixers(lm) and not _takes_mask_dict(lm) and not hasattr(lm, "_update_linear_attn_mask"):
            import transformers  # noqa: PLC0415

            raise TypeError(f"flexgroup.patch: {self.model_type}: transformers {transformers.__version__}'s "
                            f"{type(lm).__name__} neither takes per-layer-type masks nor builds its linear-attention "
                            "mask in _update_linear_attn_mask, so the grouped layout cannot reach its stateful mixers. "
                            "Upgrade transformers (pip install -U 'transformers>=5.24') or run without grouping")

    def install_extras(self, base: torch.nn.Module, lm: torch.nn.Module) -> list:
        hybrid_attrs = _instance_kernels()

        kinds = dict(self.mixers)
        for _, name, m in self._mixers(lm):
            m.forward = types.MethodType(_grouped_mixer_forward, m)
            if _module_level(type(m), kinds[name]):
                hybrid_attrs.install(m)
        handles = []
        if _takes_mask_dict(lm):
            handles.append(lm.register_forward_pre_hook(_layer_masks_hook, with_kwargs=True))
        elif self._mixers(lm):  # transformers 5.10-style: the carrier passes create_causal_mask unchanged (4-D)
            hybrid_attrs.keep_grouped_linear_mask(lm)
        if self.text_config:
            handles.append(qwen_vl.composite_model(base).register_forward_pre_hook(visual_positions_guard, with_kwargs=True))
        return handles

    def remove_extras(self, base: torch.nn.Module, lm: torch.nn.Module) -> None:
        hybrid_attrs = _instance_kernels()

        for m in lm.modules():
            if isinstance(m.__dict__.get("forward"), types.MethodType) and m.forward.__func__ is _grouped_mixer_forward:
                del m.forward
                hybrid_attrs.uninstall(m)
        lm.__dict__.pop("_update_linear_attn_mask", None)


def no_facts(config):  # hybrids here have no windows or softcaps on their attention layers (see layer_facts)
    return None


_no_facts = no_facts  # the old private spelling


# ------------------------------------------------------------------------- grouped kernel wrappers
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("flexgroup_hybrid_fork", default=None)

# Mixers that hold their kernels as instance attributes (transformers 5.10) are wrapped by
# flexgroup.patches.hybrid_attrs, which builds on this module and registers itself here when flexgroup.patches
# is imported -- so this module never imports it (no import cycle).
INSTANCE_KERNELS = None


def _instance_kernels():
    if INSTANCE_KERNELS is None:
        raise RuntimeError("flexgroup.patches.hybrid_attrs is not registered; import flexgroup.patches first")
    return INSTANCE_KERNELS


def active_mask() -> GroupedMask | None:
    """The carrier of the grouped stateful-mixer call in progress (None outside one)."""
    fork = _ACTIVE.get()
    return None if fork is None else fork.mask


@dataclass
class _Fork:
    mask: GroupedMask
    where: str

    def plan(self, conv_kernel: int, x: torch.Tensor, dim: int) -> ForkPlan:
        """The plan on ``x``'s device (built once per forward, kept in the carrier), after checking that
        ``x`` is one packed row along ``dim``."""
        layout = self.mask.grouped_layout
        if x.shape[0] != 1 or x.shape[dim] != layout.num_tokens:
            raise RuntimeError(f"{self.where}: a grouped stateful mixer got a tensor of shape {tuple(x.shape)}, not "
                               f"one packed row of {layout.num_tokens} tokens (dim {dim}); please report it")
        return self.mask.plan(("fork", conv_kernel, str(x.device)),
                              lambda: fork_plan(layout, conv_kernel).to(x.device))

    def hit(self, kernel: str) -> None:
        """Record that the forked ``kernel`` (``"conv"`` or ``"scan"``) ran in this mixer call."""
        self.__dict__.setdefault("hits", set()).add(kernel)

    def conv_input(self, x: torch.Tensor, plan: ForkPlan) -> torch.Tensor:
        """``x`` [L + 1, C] as the conv levels gather it (a streamed chunk appends its kept context rows)."""
        return x

    def states(self) -> ForkStates:
        """The carrier of final states between depths (a streamed chunk starts roots from kept states)."""
        return ForkStates()

    def check(self, kwargs: dict, names=("cu_seqlens", "seq_idx", "initial_state", "initial_states")):
        for k in names:
            if kwargs.get(k) is not None:
                raise RuntimeError(f"{self.where}: {k!r} given to a grouped stateful mixer; flexgroup forks the "
                                   "state itself and cannot combine it with another packing: remove it")


def _conv(original):
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        """Grouped: ``hidden_states`` [1, C, L] -> [1, C, L] (:func:`flexgroup.kernels.fork.forked_conv`)."""
        fork = _ACTIVE.get()
        if fork is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        fork.check(kwargs)
        fork.hit("conv")
        plan = fork.plan(weight.shape[-1], hidden_states, -1)
        return forked_conv(original, plan, hidden_states, weight, bias, activation=activation,
                           conv_input=fork.conv_input, **kwargs)

    return causal_conv1d_fn


def _gated_delta(original):
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, *args, **kwargs):
        """Grouped: q/k [1, L, Hk, K], v [1, L, Hv, V], g/beta [1, L, Hv] -> ([1, L, Hv, V], None)."""
        fork = _ACTIVE.get()
        if fork is None:
            return original(query, key, value, g, beta, *args, **kwargs)
        if args or kwargs.get("output_final_state"):
            raise RuntimeError(f"{fork.where}: unexpected call of the gated delta rule (positional options or "
                               "output_final_state) in a grouped forward; please report it")
        fork.check(kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("initial_state", "output_final_state", "cu_seqlens")}
        fork.hit("scan")
        return forked_gated_delta(original, fork.plan(1, query, 1), query, key, value, g, beta, states=fork.states(),
                                  **kwargs), None

    return torch_chunk_gated_delta_rule


def _mamba2_scan(original):
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                          dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        """Grouped: x [1, L, H, P], dt [1, L, H], B/C [1, L, G, N] -> y [1, L, H, P]."""
        fork = _ACTIVE.get()
        if fork is None:
            return original(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                            initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                            return_final_states=return_final_states, **kwargs)
        if initial_states is not None or return_final_states:
            raise RuntimeError(f"{fork.where}: unexpected states in a grouped Mamba2 scan; please report it")
        fork.check(kwargs)
        fork.hit("scan")
        return forked_mamba2_scan(original, fork.plan(1, hidden_states, 1), hidden_states, dt, A, B, C, chunk_size,
                                  states=fork.states(),
                                  D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, **kwargs)

    return mamba2_chunk_scan


def _unfused(original):
    def mamba2_split_conv1d_scan_combined(*args, **kwargs):
        """Inside a grouped forward: ``None`` (the stock mixer then runs conv and scan separately)."""
        return None if _ACTIVE.get() is not None else original(*args, **kwargs)

    return mamba2_split_conv1d_scan_combined


_WRAPPERS = {"causal_conv1d_fn": _conv, "torch_chunk_gated_delta_rule": _gated_delta,
             "mamba2_chunk_scan": _mamba2_scan, "mamba2_split_conv1d_scan_combined": _unfused}


def _module_level(cls: type, kind: str) -> list[str]:
    """The module-level functions of ``kind`` that ``cls.forward`` does not call ([] when it calls them all)."""
    used = set(inspect.unwrap(cls.forward).__code__.co_names)
    module = sys.modules[cls.__module__]
    return [n for n in _FUNCTIONS[kind] if n not in used or not callable(getattr(module, n, None))]


def _install(m: torch.nn.Module, kind: str, model_type: str) -> None:
    """Wrap the module-level functions that ``type(m).forward`` calls (idempotent; pass-through when idle),
    or check that ``m`` holds its kernels as instance attributes (wrapped per instance by ``install_extras``);
    refuse (TypeError) a mixer that computes its state in neither way."""
    hybrid_attrs = _instance_kernels()

    cls = type(m)
    missing = _module_level(cls, kind)
    if missing:
        if hybrid_attrs.supports(m, kind):
            return
        import transformers  # noqa: PLC0415

        raise TypeError(f"flexgroup.patch: {model_type}: transformers {transformers.__version__}'s {cls.__name__}."
                        f"forward computes its {kind} state inline (it does not call {missing} of {cls.__module__}), "
                        "so flexgroup cannot fork that state exactly at response boundaries. Upgrade transformers "
                        "(flexgroup forks this mixer on 5.24: pip install -U 'transformers>=5.24') or run this model "
                        "without grouping")
    module = sys.modules[cls.__module__]
    for n in _FUNCTIONS[kind]:
        fn = getattr(module, n)
        if getattr(fn, "_flexgroup_original", None) is None:
            wrapped = _WRAPPERS[n](fn)
            wrapped._flexgroup_original = fn
            setattr(module, n, wrapped)


# ---------------------------------------------------------------------------------- mixer forward
def _grouped_mixer_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """Replacement ``forward`` of a stateful mixer: forks state on grouped inputs, else the stock forward."""
    stock = type(self).forward
    if not isinstance(attention_mask, GroupedMask):
        return stock(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    where = f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')})"
    for k in ("cache_params", "past_key_values"):
        if kwargs.get(k) is not None:
            cache = kwargs[k]
    if cache is not None:
        refuse_cache(where, "a state cache reached a stateful mixer")
    if hidden_states.shape[0] != 1 or hidden_states.shape[1] != attention_mask.local_tokens:
        raise ValueError(f"{where}: grouped inputs must be one packed row of {attention_mask.local_tokens} tokens "
                         f"(this rank's), got hidden states of shape {tuple(hidden_states.shape)}")
    stream = getattr(attention_mask, "stream", None)  # a chunk of flexgroup.stream_backward
    fork = _Fork(attention_mask, where) if stream is None else _stream_fork(stream, self, attention_mask, where)
    token = _ACTIVE.set(fork)
    try:
        out = stock(self, hidden_states, cache=None, attention_mask=None, **kwargs)
    finally:
        _ACTIVE.reset(token)
    ran = getattr(fork, "hits", set())
    if ran != {"conv", "scan"}:  # a stock path that bypassed a forked kernel leaked state across responses
        lost = sorted({"conv", "scan"} - ran)
        raise RuntimeError(f"{where}: the stock forward did not run flexgroup's forked {lost} "
                           "(this transformers version took another code path), so the state would leak across "
                           "responses; please report it with your transformers version")
    return out


STREAM_FORK: list = []  # the _Fork of a streamed chunk, registered by flexgroup.patches.hybrid_stream


def _stream_fork(stream, module, mask: GroupedMask, where: str) -> _Fork:
    if not STREAM_FORK:
        raise RuntimeError(f"{where}: a streamed chunk reached a stateful mixer but flexgroup.patches.hybrid_stream "
                           "is not loaded; please report it")
    return STREAM_FORK[0](mask, where, stream, module)


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


def _takes_mask_dict(lm: torch.nn.Module) -> bool:
    """Whether ``lm.forward`` accepts a ``{layer type: mask}`` dict as its ``attention_mask``."""
    return "dict" in inspect.unwrap(type(lm).forward).__code__.co_names


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


# ------------------------------------------------------------------------------------ patch entry
def is_patched(model: torch.nn.Module, spec: HybridArchSpec) -> bool:
    return is_patched_with(model, spec)


def patch(model: torch.nn.Module, spec: HybridArchSpec, backend: str = "auto") -> torch.nn.Module:
    """Fork stateful mixers per segment and route full attention through flexgroup; returns ``model``.

    Idempotent: patching again only updates ``backend``. Raises ValueError naming the layer class
    when a layer holds a stateful mixer flexgroup does not fork. (:func:`flexgroup.patches._common.patch_with`.)
    """
    return patch_with(model, spec, backend)


def unpatch(model: torch.nn.Module, spec: HybridArchSpec) -> torch.nn.Module:
    """Restore the previous attention implementation and the stock mixer forwards; returns ``model``."""
    return unpatch_with(model, spec)
