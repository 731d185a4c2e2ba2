"""Qwen3.5 (text ``qwen3_5_text`` / ``Qwen3_5ForCausalLM``; MoE text ``qwen3_5_moe_text``).

transformers 5.24 ``modeling_qwen3_5.py``: ``config.layer_types`` interleaves ``linear_attention``
layers (``Qwen3_5GatedDeltaNet``: causal depthwise conv of kernel ``linear_conv_kernel_dim`` over
the q/k/v projections, then the chunked gated delta rule) with ``full_attention`` layers
(``Qwen3_5Attention``: q/k RMSNorm, partial rotary with M-RoPE-style 3-row position ids, an output
gate ``sigmoid(gate) * attn``; no window, no softcap). Given 1-D position ids the text model expands
them to identical rows, so the virtual positions reach every rotary section unchanged; the output gate
acts per token. The GatedDeltaNet layers are forked per segment by :mod:`flexgroup.patches.hybrid`.
MoE layers (``qwen3_5_moe_text``) route per token.

The vision-language ``qwen3_5`` (``Qwen3_5ForConditionalGeneration``): only the decoder
(``model.language_model``) is switched and forked; the vision tower keeps its attention and runs once
per prompt. Positions are 3-row M-RoPE ids from :class:`flexgroup.MultimodalGroupedBatch` (the
model's own ``get_rope_index``); the text model then passes no text position row to its layers.
"""

from ..hybrid import GDN, GDN_SINCE, HybridArchSpec, no_facts

SPEC = HybridArchSpec(model_type="qwen3_5_text", language_model="model", facts=no_facts,
                      mixers=(("Qwen3_5GatedDeltaNet", GDN),), forks_since=GDN_SINCE)
MOE_SPEC = HybridArchSpec(model_type="qwen3_5_moe_text", language_model="model", facts=no_facts,
                          mixers=(("Qwen3_5MoeGatedDeltaNet", GDN),), forks_since=GDN_SINCE)
VL_SPEC = HybridArchSpec(model_type="qwen3_5", language_model="model", facts=no_facts,
                         mixers=(("Qwen3_5GatedDeltaNet", GDN),), forks_since=GDN_SINCE, text_config="text_config")
