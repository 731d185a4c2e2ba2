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

from . import _guards
from ._interface import grouped_inputs_hook, is_flexgroup_name, register

from . import gemma2, generic, llama, mistral, qwen2, qwen2_5_vl, qwen2_vl, qwen3, qwen3_vl
from ._common import (STATE, ArchSpec, attention_modules, check_backend, clear_layers, find_language_model,
                      prepare_layers, repatch, unwrap)

__all__ = ["patch", "unpatch", "is_patched", "REGISTRY", "HYBRIDS"]

# Vision-language families (a spec with ``attn_config``) are patched by flexgroup/patches/qwen_vl.py (decoder only)
REGISTRY: dict[str, ArchSpec] = {m.SPEC.model_type: m.SPEC for m in (llama, mistral, qwen2, qwen3, gemma2,
                                                                      qwen2_vl, qwen2_5_vl, qwen3_vl)}


# Hybrids (stateful token mixers: Gated DeltaNet, Mamba2) are patched by flexgroup/patches/hybrid.py, which forks
# their recurrent and conv state per segment; their full-attention layers use the attention above.
from . import bamba, falcon_h1, hybrid, olmo_hybrid, qwen3_5, qwen3_next  # noqa: E402

HYBRIDS: dict[str, hybrid.HybridArchSpec] = {
    s.model_type: s for s in (qwen3_5.SPEC, qwen3_5.MOE_SPEC, qwen3_5.VL_SPEC, qwen3_next.SPEC, *bamba.SPECS,
                              falcon_h1.SPEC, olmo_hybrid.SPEC)}


def _composite(spec) -> bool:
    return spec is not None and hasattr(spec, "attn_config")





def _language_model(base: torch.nn.Module, spec: ArchSpec | None) -> torch.nn.Module:
    return find_language_model(base, spec.language_model if spec else "model")


def _base(model, what: str) -> torch.nn.Module:
    """The transformers model inside ``model`` (PEFT unwrapped); TypeError saying what to pass otherwise."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"flexgroup.{what} takes a transformers model (e.g. AutoModelForCausalLM.from_pretrained(...)), "
                        f"got {type(model).__name__}")
    base = unwrap(model)
    if getattr(base, "config", None) is None:
        inner = next((k for k in ("module", "model", "base_model") if isinstance(getattr(base, k, None),
                                                                                torch.nn.Module)), None)
        hint = f" (e.g. flexgroup.{what}(wrapper.{inner}))" if inner else ""
        raise TypeError(f"flexgroup.{what}: {type(base).__name__} has no .config, so it is not a transformers model: pass "
                        f"the transformers model itself (a *ForCausalLM or its PEFT wrapper), not a wrapper around "
                        f"it{hint}")
    return base


def _patched_lm(base: torch.nn.Module) -> torch.nn.Module | None:
    """The module that carries the patch state (the language model), or None."""
    return next((m for m in base.modules() if STATE in m.__dict__), None)


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``flexgroup.patch`` was applied to ``model`` (and not undone)."""
    base = _base(model, "is_patched")
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


def patch(model: torch.nn.Module, backend: str = "auto", *, shared_prefix_dropout: bool = False) -> torch.nn.Module:
    """Route the language model's attention through flexgroup; returns ``model`` (patched in place).

    Args:
        model: a transformers decoder (``*ForCausalLM`` or the base model), optionally PEFT-wrapped.
        backend: ``"auto"``, ``"sdpa"``, ``"flex"`` or ``"flex_eager"`` (see :func:`flexgroup.attention`).
        shared_prefix_dropout: accept dropout outside attention (LoRA ``lora_dropout``, residual or
            embedding dropout) in training mode. A group's responses then share one dropout mask on
            their prompt, where the repeated baseline draws one per response: a different (still
            unbiased) training noise, not the baseline's numbers. Default False: a grouped forward
            in training mode with such dropout active raises, naming the modules.

    Idempotent: patching again only updates ``backend`` and ``shared_prefix_dropout``. Architectures
    outside ``REGISTRY`` must pass a grouped-versus-one-by-one self-check on a deep copy first;
    otherwise ValueError. Every grouped forward is checked by :mod:`flexgroup.patches._guards`.
    """
    check_backend(backend)
    base = _base(model, "patch")
    model_type = getattr(base.config, "model_type", type(base).__name__)
    spec = REGISTRY.get(model_type)
    if model_type in HYBRIDS:  # hybrids
        hybrid.patch(model, HYBRIDS[model_type], backend)
    elif _composite(spec):
        from . import qwen_vl

        qwen_vl.patch(model, spec, backend)
    else:
        lm = _language_model(base, spec) if spec else generic.language_model(base, model_type, tuple(sorted({**REGISTRY, **HYBRIDS})))
        if not repatch(lm, backend):
            if spec is None:
                spec = generic.spec_for(model_type)
                generic.self_check(base, lm, apply_fn=_apply)
            _apply(base, lm, spec, backend)
    _guards.install(base, _patched_lm(base), shared_prefix_dropout)
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
    _guards.install(base, lm, shared_prefix_dropout=False)  # here too: the generic self-check's copy needs them


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Restore the attention implementation that was active before :func:`patch`; returns ``model``."""
    base = _base(model, "unpatch")
    patched = _patched_lm(base)
    if patched is not None:
        _guards.uninstall(base, patched)
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
