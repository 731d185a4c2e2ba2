"""The TRL GRPO adapter on Qwen-VL models: images through :class:`~flexgroup.data.multimodal.MultimodalGroupedBatch`.

TRL's ``GRPOTrainer`` hands its log-prob method the rows' visual inputs batch-wide: ``pixel_values``
[patches of all rows, D] and ``image_grid_thw`` [images of all rows, 3], row after row (every completion
of a prompt carries its own copy of the prompt's images), with ``num_images`` (images per row) and
``mm_token_type_ids`` [rows, Lp + k] (0 text, 1 image, 2 video placeholder). On a Qwen2-VL, Qwen2.5-VL,
Qwen3-VL or Qwen3.5 model (one with ``get_rope_index`` and ``config.image_token_id``; Qwen3.5's Gated DeltaNet
state is forked by the patched model) the adapter

1. splits those tensors per row by each row's own placeholder tokens (:func:`rows_vision`), checking
   ``num_images``, ``mm_token_type_ids`` and each image's grid (its placeholder run) against them; where they
   disagree the call goes through TRL's stock method (one warning, exact) -- the stock forward reads them as given;
2. packs each chunk of rows ``[prompt without left padding; completion without right padding]`` as a
   vision-language trie (:meth:`MultimodalGroupedBatch.from_sequences`): rows with the same prompt tokens
   and the same pixels share the prompt, so the prompt's tokens and its images enter the model once, the
   vision tower runs once per image occurrence of the packed row (a group's images once; the same pixels in
   two different prompts once per prompt), and every token gets the
   M-RoPE ids the model's own ``get_rope_index`` gives it in its row alone;
3. reads back TRL's ``[rows, logits_to_keep]`` log-probs (and entropies), zero on padding; over the
   budget, the chunk streams with its visual inputs (:class:`~flexgroup.integrations.trl_stream.StreamedRows`).

Counted in ``trainer.flexgroup_stats[role]`` beside the tokens: ``vision_patches`` (patch rows through
the tower) and ``baseline_patches`` (what the stock method passes: every row's copy).
"""

from __future__ import annotations

from typing import Any

import torch

from flexgroup.data.mrope import MRopeIndex, split_rows
from flexgroup.data.multimodal import MultimodalGroupedBatch
from flexgroup.integrations.trl_stream import StreamedRows

__all__ = ["VISION_ARGS", "vision_rope", "rows_vision", "vision_batch"]

Tensor = torch.Tensor

#: arguments of TRL's ``_get_per_token_logps_and_entropies`` that the vision-language path implements
VISION_ARGS = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")


def vision_rope(model: Any) -> MRopeIndex | None:
    """The model's M-RoPE facts when it is a Qwen-VL model flexgroup groups (else None)."""
    try:
        return MRopeIndex.from_model(model)
    except TypeError:
        return None


def rows_vision(rope: MRopeIndex, args: dict, input_ids: Tensor, attention_mask: Tensor, stats: dict,
                ) -> tuple[list[dict | None] | None, str | None]:
    """Each row's visual inputs, split from TRL's batch-wide tensors by the row's placeholder tokens.

    Args:
        rope: the model's facts (:func:`vision_rope`).
        args: the bound arguments of TRL's method (``pixel_values``, ``image_grid_thw``, ``num_images``,
            ``mm_token_type_ids``; any may be None).
        input_ids, attention_mask: [B, Lp + k], TRL's rows.
        stats: the role's counts; ``baseline_patches`` grows by the patch rows the stock method passes.

    Returns:
        ``(per row a dict of its pixel_values [patches_i, D] and image_grid_thw [n_i, 3] or None, None)``,
        or ``(None, reason)`` when TRL's tensors do not match the rows' placeholders (the stock method runs).
    """
    am = attention_mask.bool()
    rows = [input_ids[i][am[i]].cpu() for i in range(input_ids.shape[0])]
    mm = args.get("mm_token_type_ids")
    if mm is not None:
        bad = next((i for i, r in enumerate(rows) if not torch.equal(mm[i][am[i]].cpu().int(), rope.token_types(r))),
                   None)
        if bad is not None:
            return None, f"mm_token_type_ids of row {bad} do not mark its placeholder tokens"
    try:
        split = split_rows(rows, rope, {"pixel_values": args.get("pixel_values"),
                                        "image_grid_thw": args.get("image_grid_thw"), "pixel_values_videos": None,
                                        "video_grid_thw": None, "second_per_grid_ts": None}, "TRL's visual inputs")
    except ValueError as e:
        return None, f"the visual inputs do not split into the rows' placeholders ({e})"
    n_img = args.get("num_images")
    if n_img is not None:
        got = [0 if v is None else len(v["image_grid_thw"]) for v in split]
        if [int(x) for x in n_img] != got:
            return None, f"num_images {list(n_img)} disagrees with the rows' placeholder tokens ({got})"
    stats["baseline_patches"] += sum(int(v["pixel_values"].shape[0]) for v in split if v)
    return split, None


def vision_batch(trainer, model, pid: Tensor, pm: Tensor, cid: Tensor, cm: Tensor, vision: list[dict | None],
                 stats: dict) -> tuple[MultimodalGroupedBatch, StreamedRows]:
    """Rows with non-empty completions on a Qwen-VL model, packed as one vision-language trie.

    Args:
        trainer: the flexgroup GRPO trainer; model: the model TRL passed.
        pid, pm: [n, Lp] left-padded prompts; cid, cm: [n, k] right-padded completions; vision: per row
            (:func:`rows_vision`).

    Returns:
        the batch (its ``logprobs`` are ``[n, T]`` over whole sequences) and the rows as
        :class:`StreamedRows` (``to_rows`` maps ``[n, T]`` to TRL's ``[n, k]``; ``run`` streams them).
    """
    rows = StreamedRows(trainer, model, pid, pm, cid, cm, vision=vision)
    batch = MultimodalGroupedBatch.from_sequences(rows.seqs, rows.masks, model=trainer.accelerator.unwrap_model(model),
                                                  vision=vision)
    rows.tokens = batch.num_tokens
    stats["vision_patches"] += int(batch.vision_inputs["pixel_values"].shape[0]) if batch.vision_inputs else 0
    return batch, rows
