"""Qwen2: windows only when ``use_sliding_window``, and then only on layers ``>= max_window_layers``.

The config folds both into ``config.layer_types`` (``sliding_attention`` / ``full_attention``);
``Qwen2Attention`` passes ``sliding_window=config.sliding_window`` on sliding layers and ``None``
on full layers (transformers 5.24 ``modeling_qwen2.py``).
"""

from .._common import ArchSpec, layer_types_windows


def facts(config):
    return layer_types_windows(config)


SPEC = ArchSpec(model_type="qwen2", language_model="model", facts=facts)
