"""Qwen3-Next (``qwen3_next``, ``Qwen3NextForCausalLM``).

transformers 5.24 ``modeling_qwen3_next.py``: ``Qwen3NextGatedDeltaNet`` (fused ``in_proj_qkvz`` /
``in_proj_ba``, then the same causal conv + chunked gated delta rule as Qwen3.5) on
``linear_attention`` layers, gated full attention with partial rotary on ``full_attention``
layers, sparse MoE MLPs routed per token. Router aux loss: ``output_router_logits=True`` makes the
causal-LM head read ``attention_mask`` (the grouped carrier), which raises; leave it off.
"""

from ..hybrid import GDN, GDN_SINCE, HybridArchSpec, no_facts

SPEC = HybridArchSpec(model_type="qwen3_next", language_model="model", facts=no_facts,
                      mixers=(("Qwen3NextGatedDeltaNet", GDN),), forks_since=GDN_SINCE)
