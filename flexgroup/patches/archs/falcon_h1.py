"""Falcon-H1 (``falcon_h1``, ``FalconH1ForCausalLM``).

transformers 5.24 ``modeling_falcon_h1.py``: every decoder layer runs attention (``self_attn``) and a
Mamba2 mixer (``FalconH1Mixer``) side by side on the same input, with muP multipliers. The mixer
calls the same ``causal_conv1d_fn`` / ``mamba2_chunk_scan`` as Bamba's, so
:mod:`flexgroup.patches.hybrid` forks it per segment; the layer receives the carrier as its
``mamba_attention_mask`` (the ``linear_attention`` entry of the per-layer-type masks).
"""

from ..hybrid import MAMBA2, HybridArchSpec, no_facts

SPEC = HybridArchSpec(model_type="falcon_h1", language_model="model", facts=no_facts,
                      mixers=(("FalconH1Mixer", MAMBA2),))
