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
class runs once, grouped, on a tiny packed row (:func:`_probe`); it must run the forked conv and scan
and equal each sequence run alone, or ``patch`` refuses the model naming what the mixer did. At run
time a grouped mixer call that bypassed a forked kernel raises, and a grouped forward in which a
mixer did not take the grouped path at all (its forward replaced after ``patch``, for example by
``kernels.kernelize``) raises at the end of the language model's forward (:func:`_mixers_ran_hook`).

GPU note: with fla / causal-conv1d / mamba-ssm installed, the same padded calls go to their
kernels (they take ``initial_state(s)`` of shape ``[N, ...]``); varlen (``cu_seqlens``) packing is
not used. That path is untested here (no GPU, kernels not installed).
"""

from __future__ import annotations

import contextvars
import sys
import types
from dataclasses import dataclass

import torch

from flexgroup.data.carrier import GroupedMask
from flexgroup.layout import Layout
from flexgroup.kernels.fork import ForkPlan, ForkStates, fork_plan, forked_conv, forked_gated_delta, forked_mamba2_scan

from . import qwen_vl
from ._common import ArchSpec, find_language_model, is_patched_with, patch_with, unpatch_with
from ._guards import visual_positions_guard
from ._interface import refuse_cache
from .hybrid_discovery import stateful_modules

__all__ = ["HybridArchSpec", "patch", "unpatch", "is_patched", "fork_plan", "ForkPlan", "stateful_modules",
           "GDN", "MAMBA2", "active_mask", "cannot_fork", "BypassedFork"]

# mixer kind -> the module-level functions of the mixer's modeling module that flexgroup wraps: the conv and
# the scan (forked), and Mamba2's fused training shortcut (answers None inside a grouped call)
GDN = "gated_deltanet"
MAMBA2 = "mamba2"
# the oldest transformers the suite forks Gated DeltaNet hybrids on (5.10.4: kernels held as instance attributes,
# flexgroup.patches.hybrid_attrs); Mamba2 hybrids: the spec's default (their 5.10 scans run inline)
GDN_SINCE = "5.10.4"
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
        tiny grouped row per mixer class (:func:`_probe`), that they fork exactly."""
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
            if name not in probed:
                probed.add(name)
                if (finding := _probe(m, kinds[name], lm.config.hidden_size)) is not None:
                    raise cannot_fork(self, name, finding)

    def install_extras(self, base: torch.nn.Module, lm: torch.nn.Module) -> list:
        hybrid_attrs = _instance_kernels()

        kinds = dict(self.mixers)
        for _, name, m in self._mixers(lm):
            _take_forward(m)
            if _holds_kernels(m, kinds[name]):
                hybrid_attrs.install(m)
        handles = []
        if hasattr(lm, "_update_linear_attn_mask"):  # transformers 5.10-style: the carrier passes unchanged
            hybrid_attrs.keep_grouped_linear_mask(lm)
        else:  # the language model takes per-layer-type masks (and passes a dict through unchanged)
            handles.append(lm.register_forward_pre_hook(_layer_masks_hook, with_kwargs=True))
        if self._mixers(lm):
            handles.append(lm.register_forward_pre_hook(_start_mixer_record))
            handles.append(lm.register_forward_hook(_mixers_ran_hook(self), with_kwargs=True))
        if self.text_config:
            handles.append(qwen_vl.composite_model(base).register_forward_pre_hook(visual_positions_guard, with_kwargs=True))
        return handles

    def remove_extras(self, base: torch.nn.Module, lm: torch.nn.Module) -> None:
        hybrid_attrs = _instance_kernels()

        for m in lm.modules():
            if isinstance(m.__dict__.get("forward"), types.MethodType) and m.forward.__func__ is _grouped_mixer_forward:
                _give_back_forward(m)
                hybrid_attrs.uninstall(m)
        lm.__dict__.pop("_update_linear_attn_mask", None)


def no_facts(config):  # hybrids here have no windows or softcaps on their attention layers (see layer_facts)
    return None


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


def _module_level(m: torch.nn.Module, kind: str) -> list[str]:
    """The functions of ``_FUNCTIONS[kind]`` that ``m``'s modeling module defines (callables; transformers
    5.25 makes each a ``kernels`` function module), whether or not ``forward`` names them itself."""
    module = sys.modules[type(m).__module__]
    return [n for n in _FUNCTIONS[kind] if callable(getattr(module, n, None))]


def _holds_kernels(m: torch.nn.Module, kind: str) -> bool:
    """Whether ``m``'s modeling module lacks the conv or the scan function: its kernels are then instance
    attributes (transformers 5.10, :mod:`flexgroup.patches.hybrid_attrs`) or flexgroup cannot fork it."""
    names = _module_level(m, kind)
    return not (any("conv" in n for n in names) and any("scan" in n or "rule" in n for n in names))


def _install(m: torch.nn.Module, kind: str, spec: HybridArchSpec) -> None:
    """Wrap the module-level kernels of ``m``'s modeling module (idempotent; pass-through when idle), or check
    that ``m`` holds its kernels as instance attributes (wrapped per instance by ``install_extras``); refuse
    (TypeError) a mixer that offers neither. Whether the wrapped kernels are the ones ``m`` runs is decided by
    :func:`_probe`, not here."""
    if _holds_kernels(m, kind):
        if _instance_kernels().supports(m, kind):
            return
        raise cannot_fork(spec, type(m).__name__, f"its module {type(m).__module__} lacks some of the {kind} "
                          f"functions flexgroup wraps ({list(_FUNCTIONS[kind])}) and the mixer holds no kernel "
                          "attributes flexgroup knows")
    module = sys.modules[type(m).__module__]
    for n in _module_level(m, kind):
        fn = getattr(module, n)
        if getattr(fn, "_flexgroup_original", None) is None:
            wrapped = _WRAPPERS[n](fn)
            wrapped._flexgroup_original = fn
            setattr(module, n, wrapped)


def cannot_fork(spec: HybridArchSpec, mixer: str, finding: str) -> TypeError:
    """The refusal of ``patch`` for a mixer it cannot fork: the installed versions, what the mixer did, the fix."""
    import transformers  # noqa: PLC0415
    from packaging.version import Version  # noqa: PLC0415  (a transformers dependency)

    installed = transformers.__version__
    if Version(installed) < Version(spec.forks_since):
        fix = (f"flexgroup forks {spec.model_type} on transformers {spec.forks_since} and later: "
               f"pip install -U 'transformers>={spec.forks_since}', or run this model without grouping")
    else:
        fix = (f"flexgroup forks {spec.model_type} on the transformers releases in docs/compatibility.md "
               f"({spec.forks_since} and later, as tested); this release changed the mixer in a way flexgroup does "
               "not handle yet: please report it with the output of `flexgroup doctor`. Meanwhile run this model "
               "without grouping, or install a tested transformers")
    return TypeError(f"flexgroup.patch: {spec.model_type}: transformers {installed} (torch {torch.__version__}), "
                     f"{mixer}: {finding}, so flexgroup cannot fork its state exactly at response boundaries. {fix}")


def _kernelized(m: torch.nn.Module) -> list[str]:
    """Names of the functions (and the layer itself) that ``kernels.kernelize`` replaced on ``m``."""
    funcs = m.__dict__.get("_kernel_funcs", {})
    names = [n for n, f in funcs.items() if "_kernel_repo" in getattr(f, "__dict__", {})]
    return names + ([type(m).__name__] if "_kernel_repo" in m.__dict__ else [])


def _probe_tolerance(dtype: torch.dtype) -> float:
    return 5e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-3


def _probe(m: torch.nn.Module, kind: str, hidden_size: int) -> str | None:
    """Run ``m`` once, grouped, on a tiny packed row (a 5-token prompt, responses of 3 and 4 tokens: the conv
    window straddles both response starts) and compare each sequence with the stock forward run on it alone.

    Returns None when the mixer forks exactly (within :func:`_probe_tolerance` of the largest output: a leaked
    state is off by the outputs' own size), else what went wrong. Skipped (None) for parameters that cannot
    compute here (meta, fake or distributed tensors): the run-time guards still hold there.
    """
    params = list(m.parameters())
    if not params or any(type(p) not in (torch.nn.Parameter, torch.Tensor) or p.device.type == "meta" for p in params):
        return None
    if torch._guards.detect_fake_mode() is not None:
        return None
    dtype, device = params[0].dtype, params[0].device
    layout = Layout.group(prefix_len=5, response_lens=[3, 4])
    x = torch.randn(1, layout.num_tokens, hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x.to(device=device, dtype=dtype)
    hooks = _instance_kernels()
    held = _holds_kernels(m, kind) and "_flexgroup_saved_attrs" not in m.__dict__
    if held:
        hooks.install(m)
    try:
        with torch.no_grad():
            try:
                out = _grouped_mixer_forward(m, x, attention_mask=GroupedMask(layout, device))
            except BypassedFork as e:
                kernelized = _kernelized(m)
                via = f"; kernels.kernelize replaced {kernelized} on it" if kernelized else ""
                return (f"its forward did not run all of its state through the functions flexgroup forks (forked "
                        f"conv ran: {'conv' in e.ran}, forked scan ran: {'scan' in e.ran}){via}")
            stock = _stock_forward(m)
            worst = 0.0
            for path in layout.paths():
                alone = stock(x[:, path])
                got = out[:, path]
                scale = float(alone.abs().max()) or 1.0
                worst = max(worst, float((got - alone).abs().max()) / scale)
    finally:
        if held:
            hooks.uninstall(m)
    if not worst <= _probe_tolerance(dtype):
        return (f"its grouped output differs from each sequence run alone by {worst:.2e} of the largest output "
                f"(bound {_probe_tolerance(dtype):.0e}): a state it carries is not one flexgroup forks")
    return None


# ---------------------------------------------------------------------------------- mixer forward
class BypassedFork(RuntimeError):
    """A grouped mixer call whose stock forward did not run every forked kernel (``ran``: those it did run)."""

    def __init__(self, message: str, ran: set):
        super().__init__(message)
        self.ran = ran


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
    """The forward ``m`` had before ``patch`` (bound): an instance forward set by ``kernelize``, else its class's."""
    return m.__dict__.get(_PREVIOUS) or types.MethodType(type(m).forward, m)


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
        raise BypassedFork(f"{where}: the stock forward did not run flexgroup's forked {lost} "
                           "(this transformers version took another code path), so the state would leak across "
                           "responses; please report it with your transformers version", ran)
    if (record := _RAN.get()) is not None:
        record.add(id(self))
    return out


def _start_mixer_record(module: torch.nn.Module, args: tuple) -> None:
    """Forward pre-hook on the language model: a new record of the mixers that took the grouped path."""
    _RAN.set(set())


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
                "row and leaked state across responses: their forward was replaced after flexgroup.patch (for "
                "example by kernels.kernelize) or no grouped mask reached them. Call flexgroup.patch(model) last, "
                "after kernelize and other patches")
        return None

    return hook


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
