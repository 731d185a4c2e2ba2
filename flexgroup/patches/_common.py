"""The one patch lifecycle and what every architecture shares: find the language model, prepare its layers.

:func:`install` / :func:`remove` are the only install and remove paths of every patch (text, VL,
hybrid). What differs between families is a handful of small :class:`ArchSpec` methods
(``language_model_of``, ``switch``, ``attention_layers``, ``before_switch``, ``watched``,
``layer_facts``, ``install_extras``, ``remove_extras``) that :class:`~flexgroup.patches.qwen_vl.VLArchSpec`
and :class:`~flexgroup.patches.hybrid.HybridArchSpec` override. Every hook is held as a
``RemovableHandle`` in the patch state and removed with ``handle.remove()``.
"""

from __future__ import annotations

import copy

from dataclasses import dataclass
from typing import Callable

import torch

from flexgroup.reference.model_checks import unwrap
from flexgroup.kernels import check_backend_name

from ._guards import grouped_inputs_hook
from ._interface import LayerFacts, is_flexgroup_name, register

__all__ = ["ArchSpec", "unwrap", "find_language_model", "attention_modules", "layer_types_windows", "install", "remove"]


@dataclass(frozen=True)
class ArchSpec:
    """What makes one architecture family special.

    Attributes:
        model_type: ``config.model_type``.
        language_model: attribute of a ``*ForCausalLM`` that holds the decoder (``"model"``); the
            decoder itself is recognised by its ``layers``.
        facts: ``config -> [(window or None, softcap or None)]``, one entry per decoder layer.
        from_kwargs: generic path only -- take window/softcap from the kwargs the module passes.
    """

    model_type: str
    language_model: str
    facts: Callable
    from_kwargs: bool = False

    # ---- the per-family steps of the one lifecycle (:func:`install` / :func:`remove`)
    def language_model_of(self, base: torch.nn.Module) -> torch.nn.Module:
        """The decoder (has ``.layers``) whose attention is switched and that carries the patch state."""
        return find_language_model(base, self.language_model)

    def switch(self, base: torch.nn.Module, name: str) -> None:
        """Set the attention implementation of the decoder to ``name``."""
        base.set_attn_implementation(name)

    def attention_layers(self, lm: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
        """``(layer index, attention module)`` of every layer that runs flexgroup's attention."""
        return list(enumerate(attention_modules(lm)))

    def before_switch(self, base: torch.nn.Module, lm: torch.nn.Module) -> None:
        """Checks and preparations before the switch (raise to refuse the model)."""

    def watched(self, base: torch.nn.Module) -> object:
        """Something the switch must leave unchanged (a vision tower's implementation), or None."""
        return None

    def layer_facts(self, lm: torch.nn.Module, n: int) -> list[tuple[int | None, float | None]]:
        """``(window, softcap)`` of each of the ``n`` attention layers."""
        return [(None, None)] * n if self.from_kwargs else self.facts(lm.config)

    def install_extras(self, base: torch.nn.Module, lm: torch.nn.Module) -> list:
        """More hooks and wrappers; returns the ``RemovableHandle`` s to remove on unpatch."""
        return []

    def remove_extras(self, base: torch.nn.Module, lm: torch.nn.Module) -> None:
        """Undo what :meth:`install_extras` did beyond its handles."""


def find_language_model(model: torch.nn.Module, attr: str) -> torch.nn.Module:
    """The decoder module (has ``.layers``) of ``model`` or of ``model.<attr>``."""
    if isinstance(getattr(model, "layers", None), torch.nn.ModuleList):
        return model
    sub = getattr(model, attr, None)
    if sub is not None and isinstance(getattr(sub, "layers", None), torch.nn.ModuleList):
        return sub
    raise TypeError(
        f"flexgroup.patch: cannot find the language model of {type(model).__name__} (looked for .layers and "
        f".{attr}.layers): transformers may have renamed it; please report it"
    )


def attention_modules(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """``layers[i].self_attn`` for every decoder layer, checked to carry ``layer_idx == i``."""
    mods = []
    for i, layer in enumerate(lm.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            raise TypeError(f"flexgroup.patch: {type(layer).__name__} (layer {i}) has no .self_attn")
        if getattr(attn, "layer_idx", i) != i:
            raise TypeError(f"flexgroup.patch: layers[{i}].self_attn has layer_idx {attn.layer_idx}")
        mods.append(attn)
    return mods


def layer_types_windows(config, softcap: float | None = None) -> list[tuple[int | None, float | None]]:
    """Facts for configs with ``layer_types``: ``sliding_attention`` layers get ``config.sliding_window``."""
    types = list(config.layer_types)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"config.layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    out = []
    for i, t in enumerate(types):
        if t == "sliding_attention":
            # Qwen2/3 set sliding_window=None unless use_sliding_window: the module then passes None
            w = config.sliding_window
            out.append((None if w is None else int(w), softcap))
        elif t == "full_attention":
            out.append((None, softcap))
        else:
            raise ValueError(f"layer {i} has layer type {t!r}, which flexgroup does not know")
    return out


def prepare_layers(lm: torch.nn.Module, spec: ArchSpec, backend: str, previous: str) -> None:
    """Attach :class:`LayerFacts` to every attention module of ``lm`` (``spec.attention_layers``)."""
    config = lm.config
    layers = spec.attention_layers(lm)
    facts = spec.layer_facts(lm, len(layers))
    if len(facts) != len(layers):
        raise ValueError(f"{spec.model_type}: {len(facts)} layer facts for {len(layers)} attention modules")
    for (i, m), (w, c) in zip(layers, facts):
        m._flexgroup = LayerFacts(
            layer_idx=i, window=w, softcap=None if c is None else float(c), from_kwargs=spec.from_kwargs,
            backend=backend, previous=previous, model_type=spec.model_type,
            max_positions=getattr(config, "max_position_embeddings", None), where=f"{type(m).__name__} (layer {i})",
        )


def clear_layers(lm: torch.nn.Module) -> None:
    for m in lm.modules():
        if hasattr(m, "_flexgroup"):
            del m._flexgroup


STATE = "_flexgroup_patch"  # attribute on the language model holding the patch state


def repatch(lm: torch.nn.Module, backend: str) -> bool:
    """If ``lm`` is already patched, only switch its backend (patch is idempotent); True if it was."""
    state = getattr(lm, STATE, None)
    if state is None:
        return False
    state["backend"] = backend
    for m in lm.modules():
        if isinstance(m.__dict__.get("_flexgroup"), LayerFacts):
            m._flexgroup.backend = backend
    return True


def check_backend(backend: str) -> str:
    """``backend`` if it names a kernels backend (or ``"auto"``), else ValueError listing the choices."""
    try:
        return check_backend_name(backend)
    except ValueError as e:
        raise ValueError(f"flexgroup.patch: {e}") from None


# ------------------------------------------------------------------------------------ the lifecycle
def own_config(base: torch.nn.Module) -> None:
    """Give ``base`` and its submodules a config object of their own (a deep copy; sub-configs such as a VL model's
    ``text_config`` map to the copy's): two models built from one config object (``LlamaForCausalLM(cfg)`` twice,
    a reference model made from the policy's config) share ``_attn_implementation``, so switching one model's
    attention would switch the other's too."""
    memo: dict = {}
    copy.deepcopy(base.config, memo)
    for m in base.modules():
        c = m.__dict__.get("config")
        if c is not None and id(c) in memo:
            m.config = memo[id(c)]


def install(base: torch.nn.Module, lm: torch.nn.Module, spec: ArchSpec, backend: str) -> None:
    """Switch ``lm`` to ``flexgroup_<previous>`` (on a config of its own, :func:`own_config`), attach the layer
    facts and hooks, record the state."""
    own_config(base)
    spec.before_switch(base, lm)
    previous = lm.config._attn_implementation or "sdpa"
    if is_flexgroup_name(previous):
        raise RuntimeError(f"{type(lm).__name__} already runs {previous!r} but carries no flexgroup state "
                           "(copied from a patched model?): call flexgroup.unpatch on the original first")
    before = spec.watched(base)
    name = register(previous)
    spec.switch(base, name)
    layers = spec.attention_layers(lm)
    stale = sorted({str(getattr(m, "config", lm.config)._attn_implementation) for _, m in layers} - {name})
    after = spec.watched(base)
    if stale or lm.config._attn_implementation != name or after != before:
        spec.switch(base, previous)
        tower = f"; the vision tower changed from {before!r} to {after!r}" if after != before else ""
        raise ValueError(
            f"flexgroup.patch: {spec.model_type} ({type(lm).__name__}) did not switch to {name!r} "
            f"(still {stale or lm.config._attn_implementation!r}){tower}: its attention does not go through "
            "transformers' AttentionInterface, so flexgroup would leave another kernel in charge of grouped inputs")
    prepare_layers(lm, spec, backend, previous)
    handles = [lm.register_forward_pre_hook(grouped_inputs_hook, with_kwargs=True), *spec.install_extras(base, lm)]
    setattr(lm, STATE, {"previous": previous, "name": name, "handles": handles, "backend": backend,
                         "model_type": spec.model_type})


def remove(base: torch.nn.Module, spec: ArchSpec) -> None:
    """Undo :func:`install`: the previous implementation, every hook (by its handle), the layer facts."""
    lm = spec.language_model_of(base)
    state = getattr(lm, STATE, None)
    if state is None:
        return
    spec.switch(base, state["previous"])
    for handle in state["handles"]:
        handle.remove()
    spec.remove_extras(base, lm)
    clear_layers(lm)
    delattr(lm, STATE)
