"""Hybrid decoders: the state of stateful token mixers (Gated DeltaNet, Mamba2) forked per segment.

One unit, imported in the direction of its dependencies (no module registers itself in another):

- :mod:`~flexgroup.patches.hybrid.discovery` -- ``stateful_modules``: which layers hold a stateful token mixer;
- :mod:`~flexgroup.patches.hybrid.wrappers` -- the pass-through conv / scan wrappers that fork state inside a
  grouped mixer call (``Fork``: the fork of one call; a streamed chunk's is
  :class:`flexgroup.stream.hybrid_fork.StreamFork`, made by the chunk itself);
- :mod:`~flexgroup.patches.hybrid.attrs` -- mixers holding their kernels as instance attributes (transformers 5.10);
- :mod:`~flexgroup.patches.hybrid.probe` -- the patch-time probe (does a mixer fork exactly here?) and the refusal;
- :mod:`~flexgroup.patches.hybrid.spec` -- ``HybridArchSpec``: install, the grouped mixer forward, the guards.
"""

from __future__ import annotations

from .discovery import stateful_modules
from .spec import GDN_SINCE, HybridArchSpec, no_facts
from .wrappers import GDN, MAMBA2, Fork, active_mask

__all__ = ["HybridArchSpec", "GDN", "MAMBA2", "GDN_SINCE", "no_facts", "stateful_modules", "Fork", "active_mask"]
