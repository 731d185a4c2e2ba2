"""Qwen2-VL: M-RoPE (``mrope_section`` over head_dim / 2, rows concatenated), windows as in Qwen2.

The text config folds ``use_sliding_window`` / ``max_window_layers`` into ``layer_types``;
``Qwen2VLAttention`` passes ``sliding_window`` on ``sliding_attention`` layers (transformers 5.24
``modeling_qwen2_vl.py``). ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw,
video_grid_thw)``; video T positions advance by one per temporal patch.

Positions: 3-row M-RoPE ids (3, 1, L) from the model's get_rope_index of [P; dummy]; responses continue
all three rows from the dummy's position.
"""

from .._common import layer_types_windows
from ..qwen_vl import VLArchSpec

SPEC = VLArchSpec(
    model_type="qwen2_vl", language_model="model.language_model", facts=layer_types_windows,
)
