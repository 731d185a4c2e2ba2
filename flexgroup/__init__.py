"""flexgroup: encode each shared prompt once in group-based RL training, with exact gradients.

The public surface, by layer (docs/architecture.md; imports point down the layers):

- **core** -- :class:`Layout` (a packed row as a forest of segments: ``group``, ``tree``, ``pack``,
  ``position_ids``, ``paths()``, ``cost()``, ``dense_mask()``) and :class:`Cost`;
- **masks** -- :mod:`flexgroup.patterns` (patterns on virtual positions), :mod:`flexgroup.score_mods`
  (``softcap``, ``alibi``, ``score_mod``), :mod:`flexgroup.layout.masks` (``mask_mod``, ``block_mask``, ``draw``);
- **kernels** -- :func:`attention` (exact attention over a packed row, no transformers needed);
- **data** -- :class:`GroupedBatch`, :class:`MultimodalGroupedBatch`, :func:`micro_batches` and its
  :class:`MicroBatches`;
- **models** -- :func:`patch`, :func:`unpatch`, :func:`is_patched` (transformers models);
- **front** -- :func:`verify` (:class:`VerifyReport`), :func:`score` (:class:`Scores`),
  :func:`stream_backward` (:class:`~flexgroup.stream.StreamResult`) and :func:`stream_logprobs`
  (batches bigger than one forward, under a token budget).

The core, masks and kernels import no transformers. Every public name, and every submodule
(``flexgroup.layout.masks``, ``flexgroup.kernels``, ...), is imported on first use, so ``import flexgroup``
imports neither torch nor transformers: ``flexgroup --help`` and ``--version`` answer at once.
"""

__version__ = "0.1.0"

from ._moved import install as _install_moved

_install_moved()  # the old flat import paths (flexgroup.verification.verify, flexgroup.data.batch, ...) alias the new modules

__all__ = [
    "Layout", "Cost",                                                     # core
    "patterns", "score_mods",                                             # masks
    "attention",                                                          # kernels
    "GroupedBatch", "MultimodalGroupedBatch", "micro_batches", "MicroBatches",  # data
    "patch", "unpatch", "is_patched",                                     # models
    "verify", "VerifyReport", "score", "Scores", "stream_backward", "stream_logprobs",  # front
]

_LAZY = {
    "Layout": ("flexgroup.layout", "Layout"),
    "Cost": ("flexgroup.layout", "Cost"),
    "patterns": ("flexgroup.layout.patterns", None),
    "score_mods": ("flexgroup.layout.score_mods", None),
    "attention": ("flexgroup.kernels", "attention"),
    "GroupedBatch": ("flexgroup.data.batch", "GroupedBatch"),
    "MultimodalGroupedBatch": ("flexgroup.data.multimodal", "MultimodalGroupedBatch"),
    "micro_batches": ("flexgroup.data.batch", "micro_batches"),
    "MicroBatches": ("flexgroup.data.batch", "MicroBatches"),
    "patch": ("flexgroup.patches", "patch"),
    "unpatch": ("flexgroup.patches", "unpatch"),
    "is_patched": ("flexgroup.patches", "is_patched"),
    "verify": ("flexgroup.verification.verify", "verify"),
    "VerifyReport": ("flexgroup.verification.verify", "VerifyReport"),
    "score": ("flexgroup.train.scoring", "score"),
    "Scores": ("flexgroup.train.scoring", "Scores"),
    "stream_backward": ("flexgroup.stream", "stream_backward"),
    "stream_logprobs": ("flexgroup.stream", "stream_logprobs"),
}


def __getattr__(name):  # lazy: keep `import flexgroup` free of torch and transformers
    import importlib

    if name in _LAZY:
        mod, attr = _LAZY[name]
        module = importlib.import_module(mod)
        value = globals()[name] = module if attr is None else getattr(module, attr)  # later lookups skip this
        return value
    if not name.startswith("__"):  # a submodule (flexgroup.layout.masks, ...): imported eagerly before, so still an attribute
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'flexgroup' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
