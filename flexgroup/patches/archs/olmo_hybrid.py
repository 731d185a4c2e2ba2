"""OLMo hybrid (``olmo_hybrid``, ``OlmoHybridForCausalLM``).

transformers 5.24 ``modeling_olmo_hybrid.py``: ``linear_attention`` layers hold
``OlmoHybridGatedDeltaNet`` (the same causal conv + ``torch_chunk_gated_delta_rule`` calls as
Qwen3.5's), ``full_attention`` layers ``OlmoHybridAttention``; the GDN layers are forked per
segment by :mod:`flexgroup.patches.hybrid`.
"""

from ..hybrid import GDN, GDN_SINCE, HybridArchSpec, no_facts

SPEC = HybridArchSpec(model_type="olmo_hybrid", language_model="model", facts=no_facts,
                      mixers=(("OlmoHybridGatedDeltaNet", GDN),), forks_since=GDN_SINCE)
