"""flexgroup: encode each shared prompt once in group-based RL training, with exact gradients.

Core and kernels (no transformers import): :class:`Layout`, :mod:`flexgroup.patterns`,
:func:`attention`. Everything else is imported lazily on first use: :func:`patch`, :func:`unpatch`
(models layer), :class:`GroupedBatch`, :class:`MultimodalGroupedBatch` (data layer),
:func:`verify`, :func:`stream_backward`, :func:`stream_logprobs` (front). See docs/architecture.md for the layers.
"""

from . import patterns
from .kernels import attention
from .layout import Cost, Layout

__version__ = "0.1.0"

__all__ = ["Layout", "Cost", "patterns", "attention", "patch", "unpatch", "GroupedBatch", "MultimodalGroupedBatch",
           "verify", "score", "micro_batches", "stream_backward", "stream_logprobs"]

_LAZY = {
    "patch": ("flexgroup.patches", "patch"),
    "unpatch": ("flexgroup.patches", "unpatch"),
    "GroupedBatch": ("flexgroup.batch", "GroupedBatch"),
    "MultimodalGroupedBatch": ("flexgroup.multimodal", "MultimodalGroupedBatch"),
    "verify": ("flexgroup.equivalence", "verify"),
    "score": ("flexgroup.scoring", "score"),
    "micro_batches": ("flexgroup.batch", "micro_batches"),
    "stream_backward": ("flexgroup.stream", "stream_backward"),
    "stream_logprobs": ("flexgroup.stream", "stream_logprobs"),
}


def __getattr__(name):  # lazy: keep `import flexgroup` light and transformers-free
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'flexgroup' has no attribute {name!r}")
