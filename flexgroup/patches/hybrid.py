"""Exact grouped forwards for hybrid decoders: state forking for stateful token mixers.

A hybrid decoder interleaves full-attention layers with token mixers that carry state along the
sequence: Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-hybrid) or Mamba2 (Bamba, GraniteMoeHybrid,
NemotronH, Falcon-H1).
Each such mixer is a causal depthwise convolution (kernel ``k``) followed by a chunked recurrent
scan. In a packed row ``[P; R1; ...; RG]`` a mask cannot keep ``R2`` from starting where ``R1``
ended, so flexgroup forks the state at the segment boundaries of the :class:`~flexgroup.Layout`:

- **conv**: a segment's convolution sees the last ``k - 1`` conv inputs of its parent *path*
  (gathered across as many ancestor segments as needed; zeros where the path is shorter), exactly
  the window it has in ``[ancestors; segment]`` run alone;
- **recurrent scan**: a root segment starts from zeros; every other segment starts from the final
  recurrent state of its parent segment. Segments at the same tree depth run in one call,
  right-padded, with per-sequence initial states (longest first, cut into several calls where one
  call would be less than 75% real tokens); padded steps have zero decay (``g = 0`` / ``dt = 0``)
  and zero input, so a padded row's final state is its last real token's state. The cost is about
  one pass over the packed tokens.

Gradients flow through the forked states (no detach, no cache object, nothing updated in place).

How it is wired, without copying transformers' mixer code:

- ``patch`` replaces each mixer's ``forward`` (an instance attribute, a bound method so that deep
  copies stay bound to their own module). On grouped inputs it sets a context variable and calls
  the stock forward with ``cache=None, attention_mask=None``.
- The stock forward calls its module-level ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``
  / ``mamba2_chunk_scan``; flexgroup installs pass-through wrappers for those names in the mixer's
  modeling module. Outside a grouped mixer call they call the original; inside, they split the
  packed row by depth, call the original (the torch path, or fla / causal-conv1d / mamba-ssm when
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
from functools import lru_cache

import torch
import torch.nn.functional as F

from flexgroup.carrier import GroupedMask
from flexgroup.layout import Layout

from . import qwen_vl
from ._common import STATE as _STATE
from ._common import ArchSpec, check_backend, clear_layers, find_language_model, unwrap
from ._interface import LayerFacts, grouped_inputs_hook, is_flexgroup_name, register

__all__ = ["HybridArchSpec", "patch", "unpatch", "is_patched", "fork_plan", "ForkPlan", "stateful_modules",
           "GDN", "MAMBA2"]

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


def _no_facts(config):  # hybrids here have no windows or softcaps on their attention layers
    return None


# ---------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True, eq=False)  # hashed by identity (lru_cache keys)
class _Level:
    """One call: ``n`` segments of one tree depth, right-padded to ``m`` tokens.

    depth: the tree depth of its segments (levels come in depth order).
    conv_index: LongTensor [n, k-1+m] -- packed-row token of each conv input (``L`` = a zero row):
        the last ``k-1`` tokens of the segment's ancestor path, then its own tokens.
    token_index: LongTensor [n, m] -- packed-row token of each scan step (``L`` for padding).
    parent_rows: LongTensor [n] -- each segment's parent among the final states of the previous depth
        (its levels' rows concatenated in order); None at depth 0.
    """

    depth: int
    conv_index: torch.Tensor
    token_index: torch.Tensor
    parent_rows: torch.Tensor | None

    def to(self, device) -> "_Level":
        p = None if self.parent_rows is None else self.parent_rows.to(device)
        return _Level(self.depth, self.conv_index.to(device), self.token_index.to(device), p)


@dataclass(frozen=True, eq=False)  # hashed by identity (lru_cache keys)
class ForkPlan:
    """Index tensors that split a packed row into per-depth padded batches and back.

    levels: :class:`_Level` calls in depth order (one per depth, or more where one padded call would be
        less than ``FILL`` real tokens).
    gather_back: LongTensor [L] -- for each packed token, its row in the concatenation of the levels'
        flattened ``[n * m]`` outputs.
    """

    num_tokens: int
    levels: tuple
    gather_back: torch.Tensor

    def to(self, device) -> "ForkPlan":
        return _plan_on(self, torch.device(device))


@lru_cache(maxsize=64)
def _plan_on(plan: ForkPlan, device: torch.device) -> ForkPlan:
    if device == plan.gather_back.device:
        return plan
    return ForkPlan(plan.num_tokens, tuple(lv.to(device) for lv in plan.levels), plan.gather_back.to(device))


FILL = 0.75  # a depth's segments are split into several calls where one padded call would be less real tokens


def _calls(segs: list[int], lengths: tuple) -> list[list[int]]:
    """``segs`` (longest first) cut into runs whose padded call is at least ``FILL`` real tokens."""
    out: list[list[int]] = []
    for s in segs:
        if out and sum(lengths[t] for t in out[-1]) + lengths[s] >= FILL * (len(out[-1]) + 1) * lengths[out[-1][0]]:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def _conv_context(layout: Layout, s: int, ctx: int) -> list[int]:
    """The last ``ctx`` tokens before segment ``s`` on its path (fewer near a root)."""
    before: list[int] = []
    for a in reversed(layout.ancestors[s]):  # nearest ancestor first
        if len(before) >= ctx:
            break
        before = list(layout.segment_range(a))[-(ctx - len(before)):] + before
    return before[-ctx:] if ctx else []


@lru_cache(maxsize=64)
def fork_plan(layout: Layout, conv_kernel: int) -> ForkPlan:
    """The :class:`ForkPlan` of ``layout`` for a causal conv of width ``conv_kernel`` (CPU tensors)."""
    L, ctx = layout.num_tokens, conv_kernel - 1
    depth = [len(a) for a in layout.ancestors]
    by_depth: list[list[int]] = [[] for _ in range(max(depth) + 1)]
    for s in sorted(range(layout.num_segments), key=lambda s: (-layout.lengths[s], s)):
        by_depth[depth[s]].append(s)
    row = {s: r for segs in by_depth for r, s in enumerate(segs)}  # row among the final states of its depth
    calls = [(d, segs) for d, segs_d in enumerate(by_depth) for segs in _calls(segs_d, layout.lengths)]
    levels, back, base = [], [0] * L, 0
    for d, segs in calls:
        m = layout.lengths[segs[0]]
        conv_index = torch.full((len(segs), ctx + m), L, dtype=torch.long)
        token_index = torch.full((len(segs), m), L, dtype=torch.long)
        for r, s in enumerate(segs):
            own = list(layout.segment_range(s))
            before = _conv_context(layout, s, ctx)
            conv_index[r, ctx - len(before): ctx] = torch.tensor(before, dtype=torch.long)
            conv_index[r, ctx: ctx + len(own)] = torch.tensor(own, dtype=torch.long)
            token_index[r, : len(own)] = torch.tensor(own, dtype=torch.long)
            for j, t in enumerate(own):
                back[t] = base + r * m + j
        parents = None if d == 0 else torch.tensor([row[layout.parents[s]] for s in segs], dtype=torch.long)
        levels.append(_Level(d, conv_index, token_index, parents))
        base += len(segs) * m
    return ForkPlan(L, tuple(levels), torch.tensor(back, dtype=torch.long))


def _padded(x: torch.Tensor) -> torch.Tensor:
    """``x`` [1, L, ...] -> [L + 1, ...] with a zero row at index ``L`` (what padding gathers)."""
    return torch.cat([x[0], x.new_zeros((1,) + x.shape[2:])], 0)


class _States:
    """Final recurrent states of the calls so far, handed to the next depth as initial states."""

    def __init__(self):
        self.depth, self.previous, self.current = 0, None, []

    def initial(self, level: _Level) -> torch.Tensor | None:
        """[n, ...] initial states of ``level``'s rows (None at depth 0: zeros)."""
        if level.depth != self.depth:
            self.depth, self.previous, self.current = level.depth, torch.cat(self.current, 0), []
        return None if level.parent_rows is None else self.previous[level.parent_rows]

    def add(self, final: torch.Tensor) -> None:
        self.current.append(final)


def _packed(parts: list[torch.Tensor], plan: ForkPlan) -> torch.Tensor:
    """Per-level outputs [n, m, ...] -> the packed row [1, L, ...]."""
    flat = torch.cat([p.reshape((-1,) + p.shape[2:]) for p in parts], 0)
    return flat[plan.gather_back][None]


# ------------------------------------------------------------------------- grouped kernel wrappers
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("flexgroup_hybrid_fork", default=None)


@dataclass
class _Fork:
    layout: Layout
    where: str
    shard: object = None  # a RowShard under sequence parallelism (flexgroup/patches/sequence_parallel.py)

    def plan(self, conv_kernel: int, x: torch.Tensor, dim: int) -> ForkPlan:
        """The plan on ``x``'s device, after checking that ``x`` is one packed row along ``dim``."""
        if x.shape[0] != 1 or x.shape[dim] != self.layout.num_tokens:
            raise RuntimeError(f"{self.where}: a grouped stateful mixer got a tensor of shape {tuple(x.shape)}, not "
                               f"one packed row of {self.layout.num_tokens} tokens (dim {dim}); please report it")
        return fork_plan(self.layout, conv_kernel).to(x.device)

    def check(self, kwargs: dict, names=("cu_seqlens", "seq_idx", "initial_state", "initial_states")):
        for k in names:
            if kwargs.get(k) is not None:
                raise RuntimeError(f"{self.where}: {k!r} given to a grouped stateful mixer; flexgroup forks the "
                                   "state itself and cannot combine it with another packing: remove it")


def _conv(original):
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        """Grouped: ``hidden_states`` [1, C, L] -> [1, C, L], each segment after its path's last k-1 inputs."""
        fork = _ACTIVE.get()
        if fork is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        fork.check(kwargs)
        plan = fork.plan(weight.shape[-1], hidden_states, -1)
        x = _padded(hidden_states.transpose(1, 2))  # [L+1, C]
        ctx = weight.shape[-1] - 1
        parts = []
        for lv in plan.levels:
            xs = x[lv.conv_index].transpose(1, 2)  # [n, C, k-1+m]
            out = original(xs, weight, bias, activation=activation, **kwargs)  # stock: causal, zero left pad
            parts.append(out[:, :, ctx:].transpose(1, 2))  # [n, m, C]
        return _packed(parts, plan).transpose(1, 2)

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
        plan = fork.plan(1, query, 1)
        outs, states = [], _States()
        rows = [_padded(t) for t in (query, key, value, g, beta)]
        for lv in plan.levels:
            q, k, v, gl, bl = (t[lv.token_index] for t in rows)  # [n, m, ...], padding: zeros
            out, final = original(q, k, v, g=gl, beta=bl, initial_state=states.initial(lv), output_final_state=True,
                                  **kwargs)
            states.add(final)
            outs.append(out)
        return _packed(outs, plan), None

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
        # the scan's own dt preprocessing, done first so that padded steps can get dt = 0 (no decay, no input)
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            dt = F.softplus(dt)
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
        plan = fork.plan(1, hidden_states, 1)
        outs, states = [], _States()
        rows = [_padded(t) for t in (hidden_states, dt, B, C)]
        for lv in plan.levels:
            x, d, b, c = (t[lv.token_index] for t in rows)  # [n, m, ...], padding: zeros
            # dt is final (clamped above): a lower limit here would lift the padded steps' dt = 0
            out, final = original(x, d, A, b, c, chunk_size, D=D, dt_bias=None, initial_states=states.initial(lv),
                                  dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=True,
                                  **kwargs)
            states.add(final)
            outs.append(out)
        return _packed(outs, plan)

    return mamba2_chunk_scan


def _unfused(original):
    def mamba2_split_conv1d_scan_combined(*args, **kwargs):
        """Inside a grouped forward: ``None`` (the stock mixer then runs conv and scan separately)."""
        return None if _ACTIVE.get() is not None else original(*args, **kwargs)

    return mamba2_split_conv1d_scan_combined


_WRAPPERS = {"causal_conv1d_fn": _conv, "torch_chunk_gated_delta_rule": _gated_delta,
             "mamba2_chunk_scan": _mamba2_scan, "mamba2_split_conv1d_scan_combined": _unfused}


def _install(cls: type, kind: str) -> None:
    """Wrap the module-level functions that ``cls.forward`` calls (idempotent; pass-through when idle)."""
    names = _FUNCTIONS[kind]
    used = set(inspect.unwrap(cls.forward).__code__.co_names)
    module = sys.modules[cls.__module__]
    missing = [n for n in names if n not in used or not callable(getattr(module, n, None))]
    if missing:
        raise TypeError(f"flexgroup.patch: {cls.__name__}.forward no longer calls {missing} of {cls.__module__}: "
                        "this transformers version computes its state differently and flexgroup cannot fork it "
                        "exactly; please report it")
    for n in names:
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
        raise RuntimeError(f"{where}: a state cache reached a stateful mixer with grouped inputs; grouped forwards "
                           "are for scoring/training only: pass use_cache=False and no cache")
    layout = attention_mask.grouped_layout
    if hidden_states.shape[0] != 1 or hidden_states.shape[1] != attention_mask.local_tokens:
        raise ValueError(f"{where}: grouped inputs must be one packed row of {attention_mask.local_tokens} tokens "
                         f"(this rank's), got hidden states of shape {tuple(hidden_states.shape)}")
    token = _ACTIVE.set(_Fork(layout, where, attention_mask.shard))
    try:
        return stock(self, hidden_states, cache=None, attention_mask=None, **kwargs)
    finally:
        _ACTIVE.reset(token)


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


# --------------------------------------------------------------------------------------- discovery
_STATEFUL_NAME = ("mamba", "deltanet", "deltaattention", "rwkv", "shortconv", "lightning", "recurrent", "linearattn",
                  "linearattention", "mixer", "retention", "hyena", "mlstm", "slstm", "ssm")


def _causal_depthwise_conv(m: torch.nn.Module) -> bool:
    return (isinstance(m, torch.nn.Conv1d) and m.groups == m.in_channels == m.out_channels and m.kernel_size[0] > 1
            and m.padding == (m.kernel_size[0] - 1,))


def stateful_modules(lm: torch.nn.Module) -> list[tuple[int, str, torch.nn.Module]]:
    """``(layer index, class name, module)`` of every token mixer in ``lm.layers`` that carries state.

    Found by class name without the model-type prefix (Mamba, DeltaNet, RWKV, ShortConv, linear
    attention, ...) or by a causal depthwise ``Conv1d`` (``groups == channels``, ``padding ==
    kernel - 1``), reported as the module holding it. Outermost match per subtree.
    """
    found = []
    prefix = str(getattr(lm.config, "model_type", "")).replace("_", "").lower()  # "KimiLinearAttention" is not linear
    for i, layer in enumerate(lm.layers):
        seen: list[str] = []
        for name, m in layer.named_modules():
            if any(name == s or name.startswith(s + ".") for s in seen):
                continue
            cls = type(m).__name__.lower().replace("_", "")
            cls = cls[len(prefix):] if prefix and cls.startswith(prefix) else cls
            if name and any(k in cls for k in _STATEFUL_NAME):
                found.append((i, type(m).__name__, m))
                seen.append(name)
            elif _causal_depthwise_conv(m):
                owner = name.rpartition(".")[0]
                holder = layer.get_submodule(owner) if owner else layer
                found.append((i, type(holder).__name__, holder))
                seen.append(owner or name)
    return found


def _attention_of(layer: torch.nn.Module, spec: HybridArchSpec):
    """The full-attention module of ``layer`` (an ``*Attention`` under one of ``spec.attention``) or None."""
    for attr in spec.attention:
        m = getattr(layer, attr, None)
        if m is not None and "Attention" in type(m).__name__ and type(m).__name__ not in dict(spec.mixers):
            return m
    return None


# ------------------------------------------------------------------------------------ patch entry
def _language_model(base: torch.nn.Module, spec: HybridArchSpec) -> torch.nn.Module:
    return qwen_vl.language_model(base) if spec.text_config else find_language_model(base, spec.language_model)


def _switch(base: torch.nn.Module, spec: HybridArchSpec, name: str) -> None:
    base.set_attn_implementation({spec.text_config: name} if spec.text_config else name)


def is_patched(model: torch.nn.Module, spec: HybridArchSpec) -> bool:
    return getattr(_language_model(unwrap(model), spec), _STATE, None) is not None


def patch(model: torch.nn.Module, spec: HybridArchSpec, backend: str = "auto") -> torch.nn.Module:
    """Fork stateful mixers per segment and route full attention through flexgroup; returns ``model``.

    Idempotent: patching again only updates ``backend``. Raises ValueError naming the layer class
    when a layer holds a stateful mixer flexgroup does not fork.
    """
    check_backend(backend)
    base = unwrap(model)
    lm = _language_model(base, spec)
    state = getattr(lm, _STATE, None)
    if state is not None:
        state["backend"] = backend
        for m in lm.modules():
            if isinstance(getattr(m, "_flexgroup", None), LayerFacts):
                m._flexgroup.backend = backend
        return model
    kinds = dict(spec.mixers)
    mixers, unknown = [], []
    for i, name, m in stateful_modules(lm):
        (mixers if name in kinds else unknown).append((i, name, m))
    if unknown:
        i, name, _ = unknown[0]
        raise ValueError(f"flexgroup.patch: {spec.model_type}: layer {i} holds {name}, a stateful token mixer that "
                         f"flexgroup does not fork (it forks {sorted(kinds)}); a packed row would leak its state "
                         "across responses. Run this model without grouping")
    attn = [(i, a) for i, layer in enumerate(lm.layers) if (a := _attention_of(layer, spec)) is not None]
    previous = lm.config._attn_implementation or "sdpa"
    if is_flexgroup_name(previous):
        raise RuntimeError(f"{type(lm).__name__} already runs {previous!r} but carries no flexgroup state "
                           "(copied from a patched model?): call flexgroup.unpatch on the original first")
    for _, name, m in mixers:
        _install(type(m), kinds[name])
    vision = qwen_vl.vision_tower(base, spec) if spec.text_config else None
    vision_impl = None if vision is None else vision.config._attn_implementation
    name = register(previous)
    _switch(base, spec, name)
    stale = sorted({str(a.config._attn_implementation) for _, a in attn} - {name})
    if stale or lm.config._attn_implementation != name or (vision is not None and
                                                          vision.config._attn_implementation != vision_impl):
        _switch(base, spec, previous)
        raise ValueError(f"flexgroup.patch: {spec.model_type}: attention did not switch to {name!r} (still "
                         f"{stale or lm.config._attn_implementation!r}) or the vision tower's changed; please "
                         "report it")
    for i, a in attn:
        a._flexgroup = LayerFacts(layer_idx=i, backend=backend, previous=previous, model_type=spec.model_type,
                                  max_positions=getattr(lm.config, "max_position_embeddings", None),
                                  where=f"{type(a).__name__} (layer {i})")
    for _, _, m in mixers:
        m.forward = types.MethodType(_grouped_mixer_forward, m)
    guard = lm.register_forward_pre_hook(grouped_inputs_hook, with_kwargs=True)
    masks = lm.register_forward_pre_hook(_layer_masks_hook, with_kwargs=True)
    visual = (qwen_vl._inner(base).register_forward_pre_hook(qwen_vl._visual_positions_guard, with_kwargs=True)
              if spec.text_config else None)
    setattr(lm, _STATE, {"previous": previous, "name": name, "hook_ids": (guard.id, masks.id), "backend": backend,
                         "model_type": spec.model_type, "guard": visual})
    return model


def unpatch(model: torch.nn.Module, spec: HybridArchSpec) -> torch.nn.Module:
    """Restore the previous attention implementation and the stock mixer forwards; returns ``model``."""
    base = unwrap(model)
    lm = _language_model(base, spec)
    state = getattr(lm, _STATE, None)
    if state is None:
        return model
    _switch(base, spec, state["previous"])
    if state["guard"] is not None:
        state["guard"].remove()
    for hid in state["hook_ids"]:
        lm._forward_pre_hooks.pop(hid, None)
        lm._forward_pre_hooks_with_kwargs.pop(hid, None)
    for m in lm.modules():
        if isinstance(m.__dict__.get("forward"), types.MethodType) and m.forward.__func__ is _grouped_mixer_forward:
            del m.forward
    clear_layers(lm)
    delattr(lm, _STATE)
    return model
