"""Layer 2, the data carriers: sequences <-> one packed row and what the model receives.

- :mod:`~flexgroup.data.batch` -- :class:`GroupedBatch`, ``micro_batches`` (:class:`MicroBatches`);
- :mod:`~flexgroup.data.multimodal` / :mod:`~flexgroup.data.mrope` -- :class:`MultimodalGroupedBatch` (images and
  videos in the row), M-RoPE (:class:`MRopeIndex`);
- :mod:`~flexgroup.data.padded` -- trainer tensors ([N, L], padded) -> sequences and loss masks;
- :mod:`~flexgroup.data.carrier` -- :class:`GroupedMask`, the ``attention_mask`` a patched model receives;
- :mod:`~flexgroup.data.sharding` -- a packed row padded and sliced over sequence-parallel ranks (``row_shard``);
- :mod:`~flexgroup.data.readout` -- reading per-sequence log-probs out of a row's logits (``read_scores``);
- :mod:`~flexgroup.data.fused_readout` -- the same read from the final hidden states and the LM head, chunked
  (``read_scores_fused``, :class:`LMHead`);
- :mod:`~flexgroup.data.agreement` -- ``check_agreement``: every rank holds the same batch (:class:`Fingerprint`).

Each name loads its module on first use (``import flexgroup.data`` imports no torch).
"""

from ..submodules import loader as _loader

_EXPORTS = {
    "GroupedBatch": "batch", "MicroBatches": "batch", "micro_batches": "batch",
    "MultimodalGroupedBatch": "multimodal", "MRopeIndex": "mrope",
    "GroupedMask": "carrier", "tag_position_ids": "carrier",
    "check_padded": "padded", "sequence_rows": "padded",
    "RowShard": "sharding", "row_shard": "sharding",
    "ReadPlan": "readout", "read_plan": "readout", "read_scores": "readout",
    "LMHead": "fused_readout", "hidden_forward": "fused_readout", "read_scores_fused": "fused_readout",
    "Fingerprint": "agreement", "check_agreement": "agreement",
}
__all__ = list(_EXPORTS)

__getattr__ = _loader(__name__, _EXPORTS)  # a public name, or a submodule (flexgroup.data.<module>), on first use
