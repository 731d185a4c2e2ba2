"""Mamba2 hybrids with the Bamba mixer: ``bamba``, ``granitemoehybrid`` (Granite-4.0-H), ``nemotron_h``.

transformers 5.24: ``BambaMixer``, ``GraniteMoeHybridMambaLayer`` and ``NemotronHMamba2Mixer`` share
one forward (in_proj -> causal depthwise conv of kernel ``mamba_d_conv`` / ``conv_kernel`` -> chunked
Mamba2 scan ``mamba2_chunk_scan`` -> gated RMSNorm -> out_proj); only their config names differ.
Attention layers are plain causal attention (``self_attn``; NemotronH: ``mixer``), no window or
softcap. NemotronH also has MLP / MoE-only blocks, which act per token.
"""

from ..hybrid import MAMBA2, HybridArchSpec, no_facts

SPECS = (
    HybridArchSpec(model_type="bamba", language_model="model", facts=no_facts, mixers=(("BambaMixer", MAMBA2),)),
    HybridArchSpec(model_type="granitemoehybrid", language_model="model", facts=no_facts,
                   mixers=(("GraniteMoeHybridMambaLayer", MAMBA2),)),
    HybridArchSpec(model_type="nemotron_h", language_model="model", facts=no_facts,
                   mixers=(("NemotronHMamba2Mixer", MAMBA2),), attention=("mixer",)),
)
