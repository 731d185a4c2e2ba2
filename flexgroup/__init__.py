"""flexgroup: encode each shared prompt once in group-based RL training, with exact gradients.

Core (no transformers import): :class:`Layout`, :mod:`flexgroup.patterns`, :func:`attention`.
Models layer (imports transformers lazily): :func:`patch`, :func:`unpatch`, :class:`GroupedBatch`.
"""

from . import patterns
from .layout import Cost, Layout
# Bind the functions after their submodules: `flexgroup.attention` / `flexgroup.verify` are the functions.
from .attention import attention
from .verify import verify

__version__ = "0.1.0"

__all__ = ["Layout", "Cost", "patterns", "attention", "patch", "unpatch", "GroupedBatch", "MultimodalGroupedBatch", "verify"]


def __getattr__(name):  # lazy: keep `import flexgroup` light and transformers-free
    if name in ("patch", "unpatch"):
        from . import patches

        return getattr(patches, name)
    if name == "GroupedBatch":
        from .batch import GroupedBatch

        return GroupedBatch
    if name == "MultimodalGroupedBatch":
        from .multimodal import MultimodalGroupedBatch

        return MultimodalGroupedBatch
    raise AttributeError(f"module 'flexgroup' has no attribute {name!r}")
