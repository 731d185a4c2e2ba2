"""Random ops outside attention during a grouped forward: found where they happen.

A draw on the token path (dropout of LoRA, residual or embedding dropout -- as a module or as a
function: StarCoder2 calls ``F.dropout(..., p=config.residual_dropout)`` directly --, MoE router
jitter, any ``torch.rand``) gives the G responses of a group one shared draw on their prompt, where
the repeated baseline draws one per response. Two checks, both switched off by
``flexgroup.patch(model, shared_prefix_dropout=True)``:

- **the generator watch**: a forward pre-hook reads the default CPU generator's state and every
  initialised CUDA generator's ``(seed, offset)`` when a grouped forward starts, a forward hook
  compares them when it ends, and RuntimeError names the config settings that draw. It sees every
  draw from those generators, whatever module or function makes it (about 9 us per watched module);
  and the state of every ``torch.Generator`` a module holds as an attribute (``self.gen =
  torch.Generator()``, drawn from with ``torch.rand(..., generator=self.gen)``), named in the error
  (:func:`own_generators`; found when the model's structure changes, like the dropout modules). Not
  seen: a generator created inside the forward, one kept elsewhere (a list, a global, a closure), one
  assigned to an already registered module after its first grouped forward, or one reseeded to the
  same state inside every forward;
- **the module scan** (:func:`dropout_modules`): ``nn.Dropout`` modules, found before the forward so
  that the error names them. Cached per model; rescanned only after a module never registered
  before became someone's submodule (LoRA injection, a replaced head).

The hooks that decide whether a call is grouped live in :mod:`flexgroup.patches._guards`.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.nn.modules.dropout import _DropoutNd

__all__ = ["dropout_modules", "own_generators", "structure_version", "begin", "end", "watch", "unwatch"]

HOOKS, STATE = "_flexgroup_rng_hooks", "_flexgroup_rng_state"  # on the language model and the wrapper

# Bumped whenever a module never registered before becomes anyone's submodule: the per-model list of
# dropout modules is rescanned only then, so that a forward costs a loop over the dropout modules, not over
# every module (a 32-layer LoRA model: 2,665 modules, 13 ms per scan). Modules seen before do not count:
# Llama's forward slices ``self.layers[:n]``, a new ModuleList that re-registers every layer, every forward.
_STRUCTURE = [0]
_SEEN: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


def _on_new_submodule(module, name, sub) -> None:
    if _compiling():  # dynamo tracing Llama's ``layers[:n]`` (no new module): tracing into the WeakSet failed
        return        # with an IndexError depending on garbage-collection timing
    if sub is not None and sub not in _SEEN:
        _SEEN.add(sub)
        _STRUCTURE[0] += 1


_on_registration = getattr(torch.nn.modules.module, "register_module_module_registration_hook", None)
if _on_registration is not None:
    _on_registration(_on_new_submodule)


def structure_version() -> int | None:
    """A counter that changes when modules may have gained dropout submodules (None: unknown, rescan)."""
    return _STRUCTURE[0] if _on_registration is not None else None


def dropout_modules(root: torch.nn.Module, skip: torch.nn.Module | None = None) -> list[tuple[str, _DropoutNd]]:
    """``(name relative to root, module)`` of every dropout module under ``root``, ``skip``'s subtree excluded."""
    out, stack = [], [("", root)]
    while stack:
        name, m = stack.pop()
        if m is skip:
            continue
        if isinstance(m, _DropoutNd):
            out.append((name or type(m).__name__, m))
        stack.extend((f"{name}.{k}" if name else k, c) for k, c in reversed(m._modules.items()) if c is not None)
    return out


def own_generators(root: torch.nn.Module) -> list[tuple[str, torch.Generator]]:
    """``(qualified attribute name, generator)`` of every ``torch.Generator`` held as an attribute of a
    module under ``root`` (``root`` included), e.g. ``("model.layers.0.noise.gen", gen)``."""
    out = []
    for name, m in root.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, torch.Generator):
                out.append((f"{name}.{k}" if name else k, v))
    return out


_OWN = "_flexgroup_own_generators"   # (structure version, own_generators(module)) on the watched module


def _owned(module: torch.nn.Module) -> list[tuple[str, torch.Generator]]:
    version = structure_version()
    cached = module.__dict__.get(_OWN)
    if cached is None or version is None or cached[0] != version:
        cached = module.__dict__[_OWN] = (version, own_generators(module))
    return cached[1]


def _gen_state(g: torch.Generator):
    if g.device.type == "cpu":
        return g.get_state()
    return g.initial_seed(), g.get_offset()


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


# ------------------------------------------------------------------------------- the generator watch
def _state() -> tuple:
    """The default CPU generator's state and each initialised CUDA generator's (seed, offset)."""
    cuda = ()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = tuple((g.initial_seed(), g.get_offset()) for g in torch.cuda.default_generators)
    return torch.default_generator.get_state(), cuda


def begin(module: torch.nn.Module, watching: bool) -> None:
    """Start of ``module``'s forward: remember the generators' state when ``watching``."""
    module.__dict__.pop(STATE, None)  # left by a forward that raised before its end
    if watching:
        module.__dict__[STATE] = _state(), [(n, g, _gen_state(g)) for n, g in _owned(module)]


def end(module: torch.nn.Module) -> None:
    """End of ``module``'s forward: RuntimeError naming the cause and the fix if a generator advanced."""
    saved = module.__dict__.pop(STATE, None)
    if saved is None:
        return
    before, owned = saved
    after = _state()
    moved = [n for n, g, st in owned if not _same(st, _gen_state(g))]
    if before[1] == after[1] and torch.equal(before[0], after[0]) and not moved:
        return
    if moved:
        which = f"the module's own torch.Generator {', '.join(repr(n) for n in moved)} advanced"
    else:
        which = f"the {'CUDA' if before[1] != after[1] else 'CPU'} random generator advanced"
    mode = "training" if module.training else "eval"
    raise RuntimeError(
        f"{type(module).__name__}: a random op ran during a grouped forward ({mode} "
        f"mode; {which}): functional dropout (F.dropout, e.g. StarCoder2's residual "
        f"dropout), router jitter or any other sampling on the token path gives the responses of a group one shared "
        f"draw on their prompt, where the repeated baseline draws one per response.{_settings(module)} Set "
        "the dropout probabilities / noise to 0 or call model.eval() (a random op that runs in eval mode too must "
        "go), or accept the shared draw explicitly with flexgroup.patch(model, shared_prefix_dropout=True). (Another "
        "thread drawing from the same generator during the forward reads the same way.)")


def _settings(module: torch.nn.Module) -> str:
    """`` Config settings that draw: ...`` naming the config's non-zero dropout / noise values, or ''."""
    config = getattr(module, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else None
    found = {}
    for c in (config, text):
        for k, v in (vars(c) if c is not None else {}).items():
            if any(w in k for w in ("dropout", "pdrop", "jitter", "noise")) and isinstance(v, (int, float)) \
                    and not isinstance(v, bool) and v > 0:
                found.setdefault(k, v)
    return f" Config settings that draw: {', '.join(f'{k}={v}' for k, v in found.items())}." if found else ""


def watch(module: torch.nn.Module, before: Callable, after: Callable) -> None:
    """Register ``before`` as a first forward pre-hook and ``after`` as a forward hook (kwargs; idempotent)."""
    if HOOKS not in module.__dict__:
        module.__dict__[HOOKS] = (module.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
                                  module.register_forward_hook(after, with_kwargs=True))


def unwatch(module: torch.nn.Module) -> None:
    """Remove what :func:`watch` registered."""
    for handle in module.__dict__.pop(HOOKS, ()):
        handle.remove()
    module.__dict__.pop(STATE, None)
    module.__dict__.pop(_OWN, None)
