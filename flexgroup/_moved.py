"""Old import paths of modules that moved into the layer subpackages (issue 33), kept as deprecated aliases.

``MOVED`` maps each old dotted path to its new one. :func:`install` (called by ``flexgroup/__init__.py``)
puts one finder on ``sys.meta_path``: importing an old path (``import flexgroup.equivalence``,
``from flexgroup.stream_plan import plan_stream``, ``flexgroup.models``) imports the new module, warns
once with a ``FutureWarning`` naming the new path, and binds the *same* module object under the old name
-- classes, ``isinstance`` and pickles are unchanged.

``SHADOWED`` lists the two old modules whose name is now a package (``flexgroup.layout``,
``flexgroup.stream``): the package re-exports the old module's names, so they need no alias; the
rewriter (``tools/rewrite_imports.py``) maps private names (``flexgroup.stream._check_budget``) to the
module that holds them. This module imports nothing from flexgroup (layer 0).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED", "SHADOWED", "install"]

MOVED = {
    # the mask description (layer 1)
    "flexgroup.checks": "flexgroup.layout.checks",
    "flexgroup.trie": "flexgroup.layout.trie",
    "flexgroup.patterns": "flexgroup.layout.patterns",
    "flexgroup.score_mods": "flexgroup.layout.score_mods",
    "flexgroup.masks": "flexgroup.layout.masks",
    "flexgroup.blockmask": "flexgroup.layout.blockmask",
    # the reference computations (layer 1)
    "flexgroup.oracle": "flexgroup.reference.oracle",
    "flexgroup.layerwise": "flexgroup.reference.layerwise",
    # the data carriers (layer 2)
    "flexgroup.batch": "flexgroup.data.batch",
    "flexgroup.multimodal": "flexgroup.data.multimodal",
    "flexgroup.mrope": "flexgroup.data.mrope",
    "flexgroup.padded": "flexgroup.data.padded",
    "flexgroup.carrier": "flexgroup.data.carrier",
    "flexgroup.sharding": "flexgroup.data.sharding",
    "flexgroup.readout": "flexgroup.data.readout",
    # streaming (layer 4)
    "flexgroup.stream_plan": "flexgroup.stream.plan",
    "flexgroup.stream_carrier": "flexgroup.stream.chunk_carrier",
    "flexgroup.stream_shard": "flexgroup.stream.shard",
    # verification (layer 4)
    "flexgroup.equivalence": "flexgroup.verification.verify",
    "flexgroup.calibration": "flexgroup.verification.calibration",
    "flexgroup.verify_report": "flexgroup.verification.report",
    "flexgroup.memory": "flexgroup.verification.memory",
    # losses and scoring (layer 4)
    "flexgroup.grpo": "flexgroup.train.grpo",
    "flexgroup.scoring": "flexgroup.train.scoring",
    "flexgroup.evaluation": "flexgroup.train.evaluation",
    # the model zoo's old alias module
    "flexgroup.models": "flexgroup.bench.zoo",
}

# old module -> new module, where the old name is now the package that re-exports it
SHADOWED = {
    "flexgroup.layout": "flexgroup.layout.layout",
    "flexgroup.stream": "flexgroup.stream.front",
}


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside the import machinery."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib")
                                 or frame.f_code.co_filename == __file__
                                 or "importlib" in frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


class _AliasLoader(importlib.abc.Loader):
    """Binds an old dotted path to the already-imported new module (``sys.modules[old] is new``)."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return None  # a throwaway module: exec_module replaces it in sys.modules

    def exec_module(self, module):
        old = module.__spec__.name
        warnings.warn(f"{old} moved to {self.new}: import {self.new} (the old path is a deprecated alias)",
                      FutureWarning, stacklevel=_caller_stacklevel())
        sys.modules[old] = importlib.import_module(self.new)  # the import system returns sys.modules[old]


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds every old path of :data:`MOVED` (and nothing else)."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


_FINDER = _MovedFinder()


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once; idempotent)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
