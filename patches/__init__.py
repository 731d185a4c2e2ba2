"""Per-architecture patches (installed as ``flexgroup.patches``): ``patch(model)`` / ``unpatch(model)``.

``REGISTRY`` maps ``config.model_type`` to an :class:`~flexgroup.patches._common.ArchSpec` that
states, per architecture, which layers are windowed (and with what window), the attention-logit
softcap, and which submodule is the language model. Every other decoder goes through the
self-checked generic path (:mod:`flexgroup.patches.generic`).

Patching registers ``flexgroup_<previous>`` with transformers' ``AttentionInterface`` and switches
the model to it with ``set_attn_implementation`` -- no modeling code is rewritten. Grouped inputs
(a :class:`flexgroup.carrier.GroupedMask`) run through :func:`flexgroup.attention`; ordinary inputs go
to the previous implementation, with the mask it expects.
"""

from __future__ import annotations

import torch

from ._interface import grouped_inputs_hook, is_flexgroup_name, register

from . import gemma2, generic, llama, mistral, qwen2, qwen2_5_vl, qwen2_vl, qwen3, qwen3_vl
from ._common import (STATE, ArchSpec, attention_modules, check_backend, clear_layers, find_language_model,
                      prepare_layers, repatch, unwrap)

__all__ = ["patch", "unpatch", "is_patched", "REGISTRY", "HYBRIDS"]

# Vision-language families (a spec with ``attn_config``) are patched by patches/qwen_vl.py (decoder only)
REGISTRY: dict[str, ArchSpec] = {m.SPEC.model_type: m.SPEC for m in (llama, mistral, qwen2, qwen3, gemma2,
                                                                      qwen2_vl, qwen2_5_vl, qwen3_vl)}


# Hybrids (stateful token mixers: Gated DeltaNet, Mamba2) are patched by patches/hybrid.py, which forks
# their recurrent and conv state per segment; their full-attention layers use the attention above.
from . import bamba, hybrid, qwen3_5, qwen3_next  # noqa: E402

HYBRIDS: dict[str, hybrid.HybridArchSpec] = {
    s.model_type: s for s in (qwen3_5.SPEC, qwen3_5.MOE_SPEC, qwen3_5.VL_SPEC, qwen3_next.SPEC, *bamba.SPECS)}


def _composite(spec) -> bool:
    return spec is not None and hasattr(spec, "attn_config")





def _language_model(base: torch.nn.Module, spec: ArchSpec | None) -> torch.nn.Module:
    return find_language_model(base, spec.language_model if spec else "model")


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``flexgroup.patch`` was applied to ``model`` (and not undone)."""
    base = unwrap(model)
    if base.config.model_type in HYBRIDS:  # hybrids
        return hybrid.is_patched(model, HYBRIDS[base.config.model_type])
    spec = REGISTRY.get(base.config.model_type)
    if _composite(spec):
        from . import qwen_vl

        return qwen_vl.is_patched(model)
    try:
        lm = _language_model(base, spec)
    except TypeError:
        return False
    return getattr(lm, STATE, None) is not None


def patch(model: torch.nn.Module, backend: str = "auto") -> torch.nn.Module:
    """Route the language model's attention through flexgroup; returns ``model`` (patched in place).

    Args:
        model: a transformers decoder (``*ForCausalLM`` or the base model), optionally PEFT-wrapped.
        backend: ``"auto"``, ``"sdpa"``, ``"flex"`` or ``"flex_eager"`` (see :func:`flexgroup.attention`).

    Idempotent: patching again only updates ``backend``. Architectures outside ``REGISTRY`` must
    pass a grouped-versus-one-by-one self-check on a deep copy first; otherwise ValueError.
    """
    check_backend(backend)
    base = unwrap(model)
    config = base.config
    model_type = getattr(config, "model_type", type(base).__name__)
    if model_type in HYBRIDS:  # hybrids
        return hybrid.patch(model, HYBRIDS[model_type], backend)
    spec = REGISTRY.get(model_type)
    if _composite(spec):
        from . import qwen_vl

        return qwen_vl.patch(model, spec, backend)
    lm = _language_model(base, spec) if spec else generic.language_model(base, model_type)
    if repatch(lm, backend):
        return model
    if spec is None:
        spec = generic.spec_for(model_type)
        generic.self_check(base, lm, apply_fn=_apply)
    _apply(base, lm, spec, backend)
    return model


def _apply(base: torch.nn.Module, lm: torch.nn.Module, spec: ArchSpec, backend: str) -> None:
    previous = lm.config._attn_implementation or "sdpa"
    if is_flexgroup_name(previous):
        raise RuntimeError(f"{type(lm).__name__} already runs {previous!r} but carries no flexgroup state "
                           "(copied from a patched model?): call flexgroup.unpatch on the original first")
    name = register(previous)
    base.set_attn_implementation(name)
    mods = attention_modules(lm)
    stale = sorted({str(getattr(m, "config", lm.config)._attn_implementation) for m in mods} - {name})
    if stale or lm.config._attn_implementation != name:
        base.set_attn_implementation(previous)
        raise ValueError(
            f"flexgroup.patch: {spec.model_type} ({type(lm).__name__}) did not switch to {name!r} "
            f"(still {stale or lm.config._attn_implementation!r}): its attention does not go through "
            "transformers' AttentionInterface, so flexgroup would leave another kernel in charge of grouped inputs"
        )
    prepare_layers(lm, spec, backend, previous)
    handle = lm.register_forward_pre_hook(grouped_inputs_hook, with_kwargs=True)
    setattr(lm, STATE, {"previous": previous, "name": name, "hook_id": handle.id, "backend": backend,
                         "model_type": spec.model_type})


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Restore the attention implementation that was active before :func:`patch`; returns ``model``."""
    base = unwrap(model)
    if base.config.model_type in HYBRIDS:  # hybrids
        return hybrid.unpatch(model, HYBRIDS[base.config.model_type])
    spec = REGISTRY.get(base.config.model_type)
    if _composite(spec):
        from . import qwen_vl

        return qwen_vl.unpatch(model, spec)
    lm = _language_model(base, spec)
    state = getattr(lm, STATE, None)
    if state is None:
        return model
    base.set_attn_implementation(state["previous"])
    lm._forward_pre_hooks.pop(state["hook_id"], None)
    lm._forward_pre_hooks_with_kwargs.pop(state["hook_id"], None)
    clear_layers(lm)
    delattr(lm, STATE)
    return model
