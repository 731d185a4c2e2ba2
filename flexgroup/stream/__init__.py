"""Layer 4, streaming: trees bigger than one forward, under a token budget.

- :mod:`~flexgroup.stream.front` -- ``stream_backward`` / ``stream_logprobs`` / ``stream_forward``
  (this package was the module ``stream.py``: its names are re-exported here);
- :mod:`~flexgroup.stream.plan` -- the schedule: chunks, kept pieces, log-prob bookkeeping;
- :mod:`~flexgroup.stream.chunk_carrier` -- ``StreamMask``: a chunk's carrier, kept K/V as leaves;
- :mod:`~flexgroup.stream.shard` -- streaming on a sequence-parallel model;
- :mod:`~flexgroup.stream.vision` -- vision-language trees: the tower once per distinct image, features per chunk.
"""

from .front import *  # noqa: F401,F403
from .front import __all__  # noqa: F401


def __getattr__(name):  # a submodule loads on first use: ``flexgroup.stream.<module>`` works after ``import flexgroup``
    import importlib

    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
