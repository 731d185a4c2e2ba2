"""Qwen3: per-layer ``config.layer_types`` (full or sliding), q/k RMSNorm inside attention.

``Qwen3Attention`` passes ``sliding_window=config.sliding_window`` on ``sliding_attention`` layers
and ``None`` elsewhere (transformers 5.24 ``modeling_qwen3.py``). The q/k norms act per token and
head before RoPE, so they need nothing from flexgroup.
"""

from .._common import ArchSpec, layer_types_windows


def facts(config):
    return layer_types_windows(config)


SPEC = ArchSpec(model_type="qwen3", language_model="model", facts=facts)
