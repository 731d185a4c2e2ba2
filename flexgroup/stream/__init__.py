"""Layer 4, streaming: trees bigger than one forward, under a token budget.

- :mod:`~flexgroup.stream.front` -- ``stream_backward`` / ``stream_logprobs`` / ``stream_forward`` (its names are
  this package's);
- :mod:`~flexgroup.stream.plan` -- the schedule: chunks, kept pieces, log-prob bookkeeping;
- :mod:`~flexgroup.stream.chunk_carrier` -- ``StreamMask``: a chunk's carrier, kept K/V as leaves;
- :mod:`~flexgroup.stream.hybrid_fork` -- a hybrid mixer's fork in a chunk: roots start from kept states and conv rows;
- :mod:`~flexgroup.stream.shard` -- streaming on a sequence-parallel model;
- :mod:`~flexgroup.stream.vision` -- vision-language trees: the tower once per distinct image, features per chunk.
"""

from .front import *  # noqa: F401,F403
from .front import __all__  # noqa: F401

from ..submodules import loader as _loader

__getattr__ = _loader(__name__)  # a submodule (flexgroup.stream.<module>) loads on first use
