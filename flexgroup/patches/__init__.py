"""Per-architecture patches (installed as ``flexgroup.patches``): ``patch(model)`` / ``unpatch(model)``.

``REGISTRY`` maps ``config.model_type`` to an :class:`~flexgroup.patches._common.ArchSpec` that
states, per architecture, which layers are windowed (and with what window), the attention-logit
softcap, and which submodule is the language model: one module per family in
:mod:`flexgroup.patches.archs`; the hybrids' stateful mixers are forked by :mod:`flexgroup.patches.hybrid`.
Every other decoder goes through the self-checked generic path (:mod:`flexgroup.patches.generic`).

Patching registers ``flexgroup_<previous>`` with transformers' ``AttentionInterface`` and switches
the model to it with ``set_attn_implementation`` -- no modeling code is rewritten. Grouped inputs
(a :class:`flexgroup.data.carrier.GroupedMask`) run through :func:`flexgroup.attention`; ordinary inputs go
to the previous implementation, with the mask it expects.

The layers above (streaming, the integrations, the CLI) use only the names of ``__all__``: besides the
patch lifecycle, :func:`base_model` / :func:`patched_language_model` / :func:`find_language_model` (which
module is patched), :func:`guards_of` / :func:`check_grouped_call` / :func:`watched_outside_forward` (the
model-level guards) and :func:`is_flash_style`. The ``_``-modules are this package's own.
"""

from __future__ import annotations

import torch

from . import _guards
from ._guards import check_grouped_call, guards_of, watched_outside_forward
from . import archs, generic
from . import sequence_parallel as sp
from ._common import STATE, ArchSpec, check_backend, find_language_model, install, remove, repatch, unwrap
from ._interface import is_flash_style
from .hybrid import HybridArchSpec

__all__ = ["patch", "unpatch", "is_patched", "REGISTRY", "HYBRIDS",
           # the seams the layers above use (streaming, integrations, CLI)
           "base_model", "patched_language_model", "find_language_model", "unwrap", "guards_of", "check_grouped_call",
           "watched_outside_forward", "is_flash_style"]

# The one registry: config.model_type -> spec (the modules of flexgroup/patches/archs/). Text decoders (ArchSpec),
# Qwen vision-language decoders (VLArchSpec, flexgroup/patches/qwen_vl.py: the decoder only) and hybrids with
# stateful token mixers (HybridArchSpec, flexgroup/patches/hybrid/: state forked per segment) go through the
# same lifecycle (flexgroup/patches/_common.py: install / remove), driven by the spec's methods.
REGISTRY: dict[str, ArchSpec] = {s.model_type: s for s in archs.SPECS}
#: the registry's hybrids (stateful token mixers whose state is forked per segment)
HYBRIDS: dict[str, HybridArchSpec] = {k: s for k, s in REGISTRY.items() if isinstance(s, HybridArchSpec)}


def base_model(model, what: str) -> torch.nn.Module:
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


def _spec(base: torch.nn.Module) -> ArchSpec:
    """The registry's spec of ``base``, or the generic path's (decoders outside the registry)."""
    model_type = getattr(base.config, "model_type", type(base).__name__)
    return REGISTRY.get(model_type) or generic.spec_for(model_type)


def patched_language_model(base: torch.nn.Module) -> torch.nn.Module | None:
    """The module of ``base`` (a :func:`base_model`) that carries the patch state (the language model), or None."""
    return next((m for m in base.modules() if STATE in m.__dict__), None)


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``flexgroup.patch`` was applied to ``model`` (and not undone)."""
    base = base_model(model, "is_patched")
    try:
        lm = _spec(base).language_model_of(base)
    except TypeError:
        return False
    return getattr(lm, STATE, None) is not None


def patch(model: torch.nn.Module, backend: str = "auto", *, shared_prefix_dropout: bool = False,
          sequence_parallel=None) -> torch.nn.Module:
    """Route the language model's attention through flexgroup; returns ``model`` (patched in place).

    Args:
        model: a transformers decoder (``*ForCausalLM`` or the base model), optionally PEFT-wrapped.
        backend: ``"auto"``, ``"sdpa"``, ``"flex"`` or ``"flex_eager"`` (see :func:`flexgroup.attention`).
        shared_prefix_dropout: accept dropout outside attention (LoRA ``lora_dropout``, residual or
            embedding dropout) in training mode. A group's responses then share one dropout mask on
            their prompt, where the repeated baseline draws one per response: a different (still
            unbiased) training noise, not the baseline's numbers. Default False: a grouped forward
            in training mode with such dropout active raises, naming the modules.
        sequence_parallel: a ``torch.distributed`` process group: Ulysses sequence parallelism over
            its ranks for inputs from ``batch.model_inputs(shard=group)`` (attention and hybrid
            mixers all-to-all to head shards; see :mod:`flexgroup.patches.sequence_parallel`).
            ValueError, naming the counts, if the model's heads cannot be split over the group.
            ``None`` (default) switches it off; unsharded inputs run as without it.

    The model gets a config object of its own first (a deep copy, rebound on every submodule that held the old
    one): a config shared with another model (both built from one config object) would otherwise switch that
    model's attention too. Idempotent: patching again only updates ``backend``, ``shared_prefix_dropout`` and
    ``sequence_parallel``. Architectures outside ``REGISTRY`` must pass a grouped-versus-one-by-one self-check on a deep copy first;
    otherwise ValueError. Every grouped forward is checked by :mod:`flexgroup.patches._guards`.
    """
    check_backend(backend)
    base = base_model(model, "patch")
    if sequence_parallel is not None:
        get_text = getattr(base.config, "get_text_config", None)
        sp.check_group(get_text() if callable(get_text) else base.config, sequence_parallel)
    model_type = getattr(base.config, "model_type", type(base).__name__)
    spec = REGISTRY.get(model_type)
    lm = spec.language_model_of(base) if spec else generic.language_model(base, model_type, tuple(sorted(REGISTRY)))
    fresh = not repatch(lm, backend)
    if fresh:
        if spec is None:
            spec = generic.spec_for(model_type)
            generic.self_check(base, lm, apply_fn=_apply)
        install(base, lm, spec, backend)
    _guards.install(base, lm, shared_prefix_dropout)
    try:
        sp.configure(lm, sequence_parallel)
    except TypeError:  # mixers this transformers cannot shard: leave the model as it was
        if fresh:
            unpatch(model)
        raise
    return model


def _apply(base: torch.nn.Module, lm: torch.nn.Module, spec: ArchSpec, backend: str) -> None:
    """The generic self-check's patch of its copy: the lifecycle and the guards."""
    install(base, lm, spec, backend)
    _guards.install(base, lm, shared_prefix_dropout=False)


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Restore the attention implementation that was active before :func:`patch`; returns ``model``."""
    base = base_model(model, "unpatch")
    patched = patched_language_model(base)
    if patched is not None:
        _guards.uninstall(base, patched)
        sp.configure(patched, None)
    remove(base, _spec(base))
    return model

from ..submodules import loader as _loader

__getattr__ = _loader(__name__)  # a submodule (flexgroup.patches.<module>) loads on first use
