"""Gemma 2: alternating sliding/full layers, attention-logit softcapping, its own query scaling.

From transformers 5.24 ``modeling_gemma2.py``: ``Gemma2Attention`` passes
``scaling=config.query_pre_attn_scalar ** -0.5`` (used as given), ``sliding_window`` on
``sliding_attention`` layers (``config.layer_types``), and ``softcap=config.attn_logit_softcapping``
on every layer, applied as ``cap * tanh(score / cap)`` after scaling and before masking -- flexgroup's
``score_mods.softcap``. The final-logit softcap acts per token in the LM head: nothing to do.
Stock sdpa ignores softcapping (``_supports_sdpa = False``); the default is eager.
"""

from .._common import ArchSpec, layer_types_windows


def facts(config):
    cap = getattr(config, "attn_logit_softcapping", None)
    return layer_types_windows(config, softcap=None if cap is None else float(cap))


SPEC = ArchSpec(model_type="gemma2", language_model="model", facts=facts)
