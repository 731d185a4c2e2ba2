"""Layer 1, the mask description: who attends to whom in a packed row -- the Layout value and its pure
functions, with no transformers import.

- :mod:`~flexgroup.layout.layout` -- :class:`Layout` (a packed row as a forest of segments) and :class:`Cost`;
- :mod:`~flexgroup.layout.checks` -- shared input checks (integers, token ids, ``bool_mask``, loss masks);
- :mod:`~flexgroup.layout.trie` -- token-level prefix trie; micro-batch row plans under a budget;
- :mod:`~flexgroup.layout.patterns` / :mod:`~flexgroup.layout.score_mods` -- patterns and score_mods on
  virtual positions;
- :mod:`~flexgroup.layout.masks` -- mask_mod, block tables, the BlockMask LRU, ``draw``.
"""

from .layout import Cost, Layout

__all__ = ["Layout", "Cost"]

from ..submodules import loader as _loader

__getattr__ = _loader(__name__)  # a submodule (flexgroup.layout.<module>) loads on first use
