"""The built-in architectures: one module of facts per model family (windows, softcaps, mixers).

Each module states what is special about its models in an :class:`~flexgroup.patches._common.ArchSpec`
(or a :class:`~flexgroup.patches.qwen_vl.VLArchSpec` / :class:`~flexgroup.patches.hybrid.HybridArchSpec`);
:data:`SPECS` lists them all, and :data:`flexgroup.patches.REGISTRY` is built from it. A new architecture is
a module here and a line in :data:`SPECS`.
"""

from __future__ import annotations

from . import bamba, falcon_h1, gemma2, llama, mistral, olmo_hybrid, qwen2, qwen2_5_vl, qwen2_vl, qwen3, qwen3_5
from . import qwen3_next, qwen3_vl

__all__ = ["SPECS"]

#: every built-in spec: text decoders, Qwen vision-language decoders, hybrids with stateful token mixers
SPECS = (llama.SPEC, mistral.SPEC, qwen2.SPEC, qwen3.SPEC, gemma2.SPEC, qwen2_vl.SPEC, qwen2_5_vl.SPEC, qwen3_vl.SPEC,
         qwen3_5.SPEC, qwen3_5.MOE_SPEC, qwen3_5.VL_SPEC, qwen3_next.SPEC, *bamba.SPECS, falcon_h1.SPEC,
         olmo_hybrid.SPEC)
