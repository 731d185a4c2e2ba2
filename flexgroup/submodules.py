"""Lazy submodules: ``flexgroup.layout.masks`` (and every other submodule) loads on first attribute use.

A subpackage's ``__init__`` sets ``__getattr__ = submodules.loader(__name__)``, so that after a bare
``import flexgroup`` the dotted path of any module works, as ``import flexgroup.layout.masks`` would, while
``import flexgroup`` itself stays free of torch and transformers. Bottom layer: imports nothing of flexgroup.
"""

from __future__ import annotations

import importlib

__all__ = ["loader"]


def loader(package: str):
    """A module-level ``__getattr__`` for ``package``: ``package.name`` imports the submodule ``name``.

    A name that is no submodule raises AttributeError (so ``hasattr`` and ``getattr(m, n, default)`` work);
    an ImportError raised inside an existing submodule propagates unchanged.
    """
    def __getattr__(name: str):
        if not name.startswith("__"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
