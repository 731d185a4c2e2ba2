"""Qwen3-VL: interleaved M-RoPE, per-frame video grids, deepstack features; no decoder windows.

- ``get_rope_index`` splits every video into single frames (``video_grid_thw`` repeated T times
  with T = 1): the prompt carries one placeholder run per frame, separated by timestamp text.
- The rotary embedding interleaves T/H/W frequencies (``mrope_section``); it only reads the
  3-row ids, so grouped ids that equal the per-sequence ids give identical rotations.
- Deepstack: visual features of some vision layers are added to the first decoder layers'
  hidden states at the placeholder positions; these exist once, in the prompt, in the packed row.
- ``Qwen3VLTextAttention`` passes no ``sliding_window`` (transformers 5.24 ``modeling_qwen3_vl.py``).

Positions: 3-row interleaved M-RoPE ids (3, 1, L) from get_rope_index of [P; dummy] (videos split per
frame); responses continue all three rows from the dummy's position.
"""

from ..qwen_vl import VLArchSpec, no_windows

SPEC = VLArchSpec(
    model_type="qwen3_vl", language_model="model.language_model", facts=no_windows,
)
