"""flexgroup: encode each shared prompt once in group-based RL training, with exact gradients.

Core (no transformers import): :class:`Layout`, :mod:`flexgroup.patterns`, :func:`attention`.
Models layer (imports transformers lazily): :func:`patch`, :func:`unpatch`, :class:`GroupedBatch`.
"""

from . import patterns
from .layout import Cost, Layout
from .attention import attention  # rebinds the name `attention` from the submodule to the function

__version__ = "0.1.0"

__all__ = ["Layout", "Cost", "patterns", "attention", "patch", "unpatch", "GroupedBatch", "verify"]


def __getattr__(name):  # lazy: keep `import flexgroup` light and transformers-free
    if name in ("patch", "unpatch"):
        from . import patches

        return getattr(patches, name)
    if name == "GroupedBatch":
        from .batch import GroupedBatch

        return GroupedBatch
    if name == "verify":
        from .verify import verify

        return verify
    raise AttributeError(f"module 'flexgroup' has no attribute {name!r}")
