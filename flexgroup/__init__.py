"""flexgroup: encode each shared prompt once in group-based RL training, with exact gradients.

The public surface, by layer (docs/architecture.md; one subpackage per layer, imports point down):

- **layout** -- :class:`Layout` (a packed row as a forest of segments: ``group``, ``tree``, ``pack``,
  ``position_ids``, ``paths()``, ``cost()``, ``dense_mask()``) and :class:`Cost`;
  :mod:`flexgroup.layout.patterns` (``patterns``: patterns on virtual positions), :mod:`flexgroup.layout.score_mods`
  (``score_mods``: ``softcap``, ``alibi``, ``score_mod``), :mod:`flexgroup.layout.masks` (``mask_mod``,
  ``block_mask``, ``draw``);
- **kernels** -- :func:`attention` (exact attention over a packed row, no transformers needed);
- **data** -- :class:`GroupedBatch`, :class:`MultimodalGroupedBatch`, :func:`micro_batches` and its
  :class:`MicroBatches`;
- **patches** -- :func:`patch`, :func:`unpatch`, :func:`is_patched` (transformers models);
- **verification**, **train**, **stream** -- :func:`verify` (:class:`VerifyReport`), :func:`score`
  (:class:`Scores`), :func:`stream_backward` (:class:`~flexgroup.stream.StreamResult`) and
  :func:`stream_logprobs` (batches bigger than one forward, under a token budget);
- **models** -- tiny random models to try things on (:mod:`flexgroup.models.zoo`, ``build_model``), not re-exported.

The layout, reference, kernels and data layers import no transformers. Every public name, and every
subpackage (``flexgroup.layout``, ``flexgroup.kernels``, ...), is imported on first use, so ``import flexgroup``
imports neither torch nor transformers: ``flexgroup --help`` and ``--version`` answer at once.
"""

__version__ = "0.1.0"

__all__ = [
    "Layout", "Cost", "patterns", "score_mods",                           # layout
    "attention",                                                          # kernels
    "GroupedBatch", "MultimodalGroupedBatch", "micro_batches", "MicroBatches",  # data
    "patch", "unpatch", "is_patched",                                     # patches
    "verify", "VerifyReport", "score", "Scores", "stream_backward", "stream_logprobs",  # verification, train, stream
]

_LAZY = {
    "Layout": ("flexgroup.layout", "Layout"),
    "Cost": ("flexgroup.layout", "Cost"),
    "patterns": ("flexgroup.layout.patterns", None),
    "score_mods": ("flexgroup.layout.score_mods", None),
    "attention": ("flexgroup.kernels", "attention"),
    "GroupedBatch": ("flexgroup.data", "GroupedBatch"),
    "MultimodalGroupedBatch": ("flexgroup.data", "MultimodalGroupedBatch"),
    "micro_batches": ("flexgroup.data", "micro_batches"),
    "MicroBatches": ("flexgroup.data", "MicroBatches"),
    "patch": ("flexgroup.patches", "patch"),
    "unpatch": ("flexgroup.patches", "unpatch"),
    "is_patched": ("flexgroup.patches", "is_patched"),
    "verify": ("flexgroup.verification", "verify"),
    "VerifyReport": ("flexgroup.verification", "VerifyReport"),
    "score": ("flexgroup.train", "score"),
    "Scores": ("flexgroup.train", "Scores"),
    "stream_backward": ("flexgroup.stream", "stream_backward"),
    "stream_logprobs": ("flexgroup.stream", "stream_logprobs"),
}


_SUBMODULES = ("layout", "reference", "kernels", "data", "patches", "stream", "verification", "train", "models",
               "integrations", "bench", "cli", "submodules", "caches")


def __getattr__(name):  # lazy: keep `import flexgroup` free of torch and transformers
    import importlib

    if name in _LAZY:
        mod, attr = _LAZY[name]
        module = importlib.import_module(mod)
        value = globals()[name] = module if attr is None else getattr(module, attr)  # later lookups skip this
        return value
    if name in _SUBMODULES:  # flexgroup.data etc. after a bare `import flexgroup`
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
