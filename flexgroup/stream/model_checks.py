"""What streaming refuses on a model, checked once per call, naming the cause and the fix (what it cannot
make exact: chunked vision-language trees outside :mod:`flexgroup.stream.vision`, the MoE load-balancing loss,
RoPE scaling or attention temperature that depend on the forward's length)."""

from __future__ import annotations

import torch

from .plan import StreamPlan
from .vision import SUPPORTED as VL_STREAMED

__all__ = ["check_model"]


def check_model(model: torch.nn.Module, plan: StreamPlan, vision: bool = False) -> None:
    """Refuse, naming the cause and the fix, what streaming cannot make exact (checked once per call)."""
    from ..patches import _base, _patched_lm
    from ..patches._guards import check_grouped_call, guards_of

    base = _base(model, "stream_backward")
    lm = _patched_lm(base)
    if lm is None:
        raise ValueError(f"flexgroup.stream_backward: {type(base).__name__} is not patched: call flexgroup.patch(model) "
                         "first")
    if not plan.chunks:
        return  # every tree fits the budget: ordinary packed rows, checked by the model's own hooks
    need = max(plan.trie.tree_tokens)
    model_type = getattr(base.config, "model_type", type(base).__name__)
    fix = f"raise the budget to {need} tokens (the largest tree) so that every tree runs as one packed forward"
    if getattr(base.config, "vision_config", None) is not None and not vision:
        raise NotImplementedError(
            f"flexgroup.stream_backward: streaming x vision-language on {model_type} is not supported: images' "
            f"features and M-RoPE positions are carried across chunks only for {', '.join(VL_STREAMED)} "
            f"(flexgroup.stream.vision): use MultimodalGroupedBatch, or {fix}")
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    if getattr(text, "output_router_logits", False):
        raise NotImplementedError(
            "flexgroup.stream_backward: output_router_logits=True (MoE load-balancing loss) reads the whole batch's "
            f"router logits in one forward, which streaming splits: set config.output_router_logits=False or {fix}")
    from ..layout import Layout

    full = Layout.tree(plan.trie.parents, plan.trie.lengths)
    g = guards_of(lm)
    longest = max(full.offsets[s] + full.lengths[s] for s in full.leaves)
    over = [(what, n) for what, n in g.rope_scalings() if longest > n]
    if over:  # before the positions check: past max_position_embeddings, dynamic scaling is the cause to name
        limit = min(n for _, n in over)
        raise NotImplementedError(
            f"flexgroup.stream_backward: this model's RoPE scaling depends on the length of each forward "
            f"({'; '.join(what for what, _ in over)}), and a sequence of {longest} tokens exceeds {limit}: a chunk "
            f"would get other factors than the sequence run alone. Keep sequences within {limit} tokens"
            + ("" if g.dynamic in (n for _, n in over) else f", or {fix}"))
    check_grouped_call(full, getattr(lm.config, "max_position_embeddings", None), model_type)
    if g.temperature_floor is not None and longest >= g.temperature_floor:
        raise NotImplementedError(
            "flexgroup.stream_backward: attention temperature tuning scales queries by each token's index in the "
            f"forward (floor_scale={g.temperature_floor}), which a chunk changes: keep sequences shorter than "
            f"{g.temperature_floor} tokens or {fix}")
