"""The one cache policy: every piece of state flexgroup keeps between calls, its key and its bound.

The rules (``tests/package/test_caches.py`` enforces them on the source):

- a process-wide cache is keyed on *values* (a :class:`~flexgroup.layout.Layout`, flexgroup's own frozen
  patterns and score_mods, ints, strings, dtypes, code objects) -- never on a user callable or another
  object whose behaviour can change between calls (such inputs are planned anew on every call);
- every process-wide cache has a bound (an LRU size, a ``maxsize``, or a finite key space named here);
- per-object memos live on the object they describe (or weakly keyed by it) and die with it;
- every module-level mutable container and every ``lru_cache`` / ``cached_property`` in ``flexgroup/`` is
  listed in :data:`CACHES` (or :data:`REGISTRIES`, for state that is not a cache): a new one fails the test
  until it is registered here with its key and bound.

It names every cache by its ``module:attribute`` string and imports nothing, so it sits at the bottom (layer 0,
beside :mod:`flexgroup.submodules`) while it lists caches of every layer up to the integrations -- not in the
layout layer, whose concern is the Layout value: :func:`clear` reaches only modules already imported.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["Cache", "CACHES", "REGISTRIES", "clear"]


@dataclass(frozen=True)
class Cache:
    """One cache: ``where`` is ``module:attribute`` (``module:Class.attribute`` for per-object memos)."""

    where: str
    kind: str      # "lru" (OrderedDict LRU), "lru_cache", "dict", "weak" (per object), "cached_property", "set"
    key: str
    bound: str
    process_wide: bool = True


CACHES = (
    Cache("flexgroup.layout.masks:_BLOCK_MASKS", "lru",
          "(layout value, pattern: None or a frozen flexgroup pattern by value, device, block_size); a user "
          "callable's block mask is built anew on every call",
          "BLOCK_MASK_CACHE_SIZE = 32"),
    Cache("flexgroup.kernels:_PLANS", "lru",
          "(backend name, layout value, frozen pattern, frozen score_mod, device, block_size, the backend's "
          "module-level settings: the lse grid's CHUNK, SUB_CELL, LEVEL_FAN, QUERY_ROWS); plans of user "
          "callables are built anew on every call", "PLAN_CACHE_SIZE = 4"),
    Cache("flexgroup.kernels.flex:_COMPILED_FLEX", "dict",
          "(device type, dtype, grad, autocast, pattern kind, score_mod kind, GQA): frozen patterns by value, "
          "user callables by their code object; values: torch.compile'd kernels (dynamo guards the closures)",
          "one per kernel kind a program uses (a handful); dynamo's recompile_limit bounds graphs per kind"),
    Cache("flexgroup.kernels.flex:_GRAPH_CODES", "dict", "the keys of _COMPILED_FLEX (their code objects)",
          "as _COMPILED_FLEX"),
    Cache("flexgroup.kernels.flex:_FALLBACK", "dict", '"why": the recompile-limit warning text', "1 entry"),
    Cache("flexgroup.kernels.flex:_CPU_KERNEL_OK", "dict",
          "(dtype, Hq, Hkv, head_dim, pattern, score_mod, scale): the compiled CPU kernel's self-check verdict; "
          "frozen patterns by value, a user callable by identity (a fresh callable is checked again)",
          "CPU_CHECK_CACHE_SIZE = 64 (oldest dropped)"),
    Cache("flexgroup.kernels.lse_ops:_CPU_FEATURES", "dict", 'feature name ("gqa", "mask"): probed once',
          "2 entries"),
    Cache("flexgroup.layout.layout:_padded", "lru_cache", "(layout value, multiple): Layout.padded", "maxsize=32"),
    Cache("flexgroup.patches._interface:window_pattern", "lru_cache",
          "window (int or None): one pattern object per value, shared by every layer", "maxsize=128"),
    Cache("flexgroup.patches._interface:softcap_mod", "lru_cache",
          "softcap (float or None): one score_mod object per value", "maxsize=128"),
    # per-object memos: keyed by the object (weakly, or stored on it), freed with it
    Cache("flexgroup.data.sharding:_CACHE", "weak",
          "a GroupedBatch (weakly) -> {(rank, world, kind): read indices}", "freed with the batch", False),
    Cache("flexgroup.data.carrier:GroupedMask._plans", "dict",
          "plan name -> this forward's plan (kernel plans, fork plans); cleared by the model-level pre-hook "
          "at the start of every forward", "one forward's plans", False),
    Cache("flexgroup.layout.layout:Layout.<cached_property>", "cached_property",
          "derived structure of an immutable Layout (starts, ancestors, euler_intervals, ...)",
          "one per property, freed with the layout", False),
)

# state kept between calls that is not a cache: registries, warn-once sets, class factories
REGISTRIES = (
    Cache("flexgroup.patches._interface:_NAMES", "dict", "registered attention name -> the one it replaced",
          "one per attention implementation registered"),
    Cache("flexgroup.patches._random:_SEEN", "weak", "modules whose random ops were already scanned (weak)",
          "freed with the modules"),
    Cache("flexgroup.kernels.lse_ops:_WARNED", "set", "warning kinds already shown", "a few"),
    Cache("flexgroup.integrations:_MIXED", "dict", "(mixin, class) -> the FlexGroup<Class> built once "
          "(isinstance stays stable)", "one per trainer class mixed"),
    Cache("flexgroup.integrations.verl:_REPLACED", "dict", "(backend, key) -> the verl engine class replaced "
          "(unregister() restores them)", "len(BACKENDS) x engine keys"),
)


def clear() -> None:
    """Empty every process-wide cache of :data:`CACHES` in the modules already imported (tests, memory)."""
    for c in CACHES:
        if not c.process_wide:
            continue
        mod, _, attr = c.where.partition(":")
        obj = getattr(sys.modules.get(mod), attr, None)
        if obj is None:
            continue
        if hasattr(obj, "cache_clear"):
            obj.cache_clear()
        elif hasattr(obj, "clear"):
            obj.clear()
