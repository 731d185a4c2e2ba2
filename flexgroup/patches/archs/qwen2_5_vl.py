"""Qwen2.5-VL: as Qwen2-VL, plus a windowed vision tower and video time scaling.

``get_rope_index`` takes ``second_per_grid_ts``: a video's temporal position advances by
``tokens_per_second * second_per_grid_ts`` per temporal patch (images: 1). The vision tower's
window attention (``fullatt_block_indexes``) is its own business; only the decoder is switched.
Decoder windows from ``layer_types`` as in Qwen2 (transformers 5.24 ``modeling_qwen2_5_vl.py``).

Positions: 3-row M-RoPE ids (3, 1, L) from get_rope_index of [P; dummy] with second_per_grid_ts;
responses continue all three rows from the dummy's position.
"""

from .._common import layer_types_windows
from ..qwen_vl import VLArchSpec

SPEC = VLArchSpec(
    model_type="qwen2_5_vl", language_model="model.language_model", facts=layer_types_windows,
)
