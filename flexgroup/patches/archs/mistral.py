"""Mistral: a sliding window on *every* layer when ``config.sliding_window`` is set.

Checked against transformers 5.24 ``modeling_mistral.py``: ``MistralAttention`` passes
``sliding_window=config.sliding_window`` to the attention function on every layer (HF semantics:
``q - kv < window``); flexgroup applies it on virtual positions.
"""

from .._common import ArchSpec


def facts(config):
    w = getattr(config, "sliding_window", None)
    return [(None if w is None else int(w), None)] * config.num_hidden_layers


SPEC = ArchSpec(model_type="mistral", language_model="model", facts=facts)
