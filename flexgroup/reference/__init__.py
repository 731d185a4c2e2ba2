"""Layer 1, the references: what a grouped forward must equal, and the checks of the model it runs.

- :mod:`~flexgroup.reference.oracle` -- the repeated baseline: one sequence alone, its log-probs
  (``logprobs_alone``, ``logits_alone``, ``own_copy``);
- :mod:`~flexgroup.reference.layerwise` -- a float64 run of a float32 model, one block in float64 at a time
  (``float64_by_layer``);
- :mod:`~flexgroup.reference.stock` -- the stock attention implementation a config needs (``stock_attention``);
- :mod:`~flexgroup.reference.model_checks` -- the checks of a given model: ``unwrap`` (the one PEFT unwrap),
  ``check_materialized`` (meta weights refused).

Each name loads its module on first use.
"""

from ..submodules import loader as _loader

_EXPORTS = {
    "logprobs_alone": "oracle", "logits_alone": "oracle", "logprobs_of": "oracle", "own_copy": "oracle",
    "unsharded_copy": "oracle",
    "float64_by_layer": "layerwise", "float64_scope": "layerwise",
    "stock_attention": "stock",
    "unwrap": "model_checks", "check_materialized": "model_checks",
}
__all__ = list(_EXPORTS)

__getattr__ = _loader(__name__, _EXPORTS)  # a public name, or a submodule (flexgroup.reference.<module>), on first use
