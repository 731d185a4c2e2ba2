"""Layer 2, the data carriers: sequences <-> one packed row and what the model receives.

- :mod:`~flexgroup.data.batch` -- :class:`GroupedBatch`, ``micro_batches``;
- :mod:`~flexgroup.data.multimodal` / :mod:`~flexgroup.data.mrope` -- images and videos in the row, M-RoPE;
- :mod:`~flexgroup.data.padded` -- trainer tensors ([N, L], padded) -> sequences and loss masks;
- :mod:`~flexgroup.data.carrier` -- ``GroupedMask``, the ``attention_mask`` a patched model receives;
- :mod:`~flexgroup.data.sharding` -- a packed row padded and sliced over sequence-parallel ranks;
- :mod:`~flexgroup.data.readout` -- reading per-sequence log-probs out of a row's logits;
- :mod:`~flexgroup.data.fused_readout` -- the same read from the final hidden states and the LM head, chunked.
"""

from ..submodules import loader as _loader

__getattr__ = _loader(__name__)  # a submodule (flexgroup.data.<module>) loads on first use
