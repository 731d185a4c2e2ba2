"""Lazy submodules and exports: ``flexgroup.layout.masks`` (and every other submodule) loads on first attribute use.

A subpackage's ``__init__`` sets ``__getattr__ = submodules.loader(__name__, EXPORTS)``, so that after a bare
``import flexgroup`` the dotted path of any module works, as ``import flexgroup.layout.masks`` would, and its
public names (``flexgroup.data.GroupedBatch``) import their module on first use, while ``import flexgroup``
itself stays free of torch and transformers. Bottom layer: imports nothing of flexgroup.
"""

from __future__ import annotations

import importlib

__all__ = ["loader"]


def loader(package: str, exports: dict[str, str] | None = None):
    """A module-level ``__getattr__`` for ``package``: ``package.name`` imports the submodule ``name``, or, for a
    name of ``exports`` (public name -> the submodule that defines it), that submodule's attribute ``name``.

    A name that is neither raises AttributeError (so ``hasattr`` and ``getattr(m, n, default)`` work); an
    ImportError raised inside an existing submodule propagates unchanged.
    """
    exports = dict(exports or {})
    clash = sorted(n for n, m in exports.items() if n == m)
    if clash:
        raise ValueError(f"{package} exports {clash}, each also the name of the submodule that defines it: "
                         "rename the module (package.name must mean one thing)")

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        if not name.startswith("__"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
