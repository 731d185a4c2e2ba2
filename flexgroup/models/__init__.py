"""Layer 4, the tiny models: built-in small models with random weights (never downloaded), for the CLI
(``flexgroup verify --arch``, ``flexgroup doctor``, ``flexgroup demo``), the benchmarks, the examples and the docs.

- :mod:`~flexgroup.models.zoo` -- ``tiny_config`` / ``build_model``: a few-layer config of each supported
  architecture (and the larger ``"demo"`` shape), ``unavailable`` (why this transformers lacks one), and the
  one FLOP model (``flops_per_token_and_pair``, ``ideal_speedup``);
- :mod:`~flexgroup.models.checkpoints` -- ``save_tiny_checkpoint``: a tiny random checkpoint with a word-level
  tokenizer, saved once into a reused cache folder.

It builds transformers models, so it sits above the patches layer; the library's own layers never import it
(only ``flexgroup.bench`` and the CLI do, besides the examples, benchmarks and tests).
"""

from ..submodules import loader as _loader

__getattr__ = _loader(__name__)  # a submodule (flexgroup.models.<module>) loads on first use
