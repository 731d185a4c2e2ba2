"""Deprecated home of the model zoo: see :mod:`flexgroup.bench.zoo` (tiny configs, ``build_model``, FLOP model)."""

from __future__ import annotations

from .bench.zoo import *  # noqa: F401,F403
from .bench.zoo import __all__  # noqa: F401
