"""Llama: causal attention on every layer, no window, no softcap; RoPE from ``position_ids``.

Checked against transformers 5.24 ``modeling_llama.py``: ``LlamaAttention`` passes ``scaling``
(``head_dim ** -0.5``) and no ``sliding_window`` / ``softcap`` kwargs.
"""

from .._common import ArchSpec


def facts(config):
    return [(None, None)] * config.num_hidden_layers


SPEC = ArchSpec(model_type="llama", language_model="model", facts=facts)
