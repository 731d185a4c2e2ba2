"""Layer 1, the references: what a grouped forward must equal.

- :mod:`~flexgroup.reference.oracle` -- the repeated baseline: one sequence alone, its log-probs;
- :mod:`~flexgroup.reference.layerwise` -- a float64 run of a float32 model, one block in float64 at a time;
- :mod:`~flexgroup.reference.stock` -- the stock attention implementation a config needs (``stock_attention``).
"""


def __getattr__(name):  # a submodule loads on first use: ``flexgroup.reference.<module>`` works after ``import flexgroup``
    import importlib

    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
