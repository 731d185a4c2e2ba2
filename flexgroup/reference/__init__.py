"""Layer 1, the references: what a grouped forward must equal.

- :mod:`~flexgroup.reference.oracle` -- the repeated baseline: one sequence alone, its log-probs;
- :mod:`~flexgroup.reference.layerwise` -- a float64 run of a float32 model, one block in float64 at a time;
- :mod:`~flexgroup.reference.stock` -- the stock attention implementation a config needs (``stock_attention``).
"""

from ..submodules import loader as _loader

__getattr__ = _loader(__name__)  # a submodule (flexgroup.reference.<module>) loads on first use
