"""Grouped batches for vision-language models with 3-D rotary positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

What changes against a text :class:`~flexgroup.data.batch.GroupedBatch`:

- **Visual inputs once per prompt.** Each prompt's images / videos (``pixel_values``,
  ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``) are concatenated group by group,
  so the vision tower runs once per prompt and its features fill the prompt's placeholder tokens,
  which appear once in the packed row. Responses must be text.
- **M-RoPE position ids** ``(3, 1, L)`` from the model's own ``get_rope_index``: the rope index of
  ``[P; one dummy text token]`` is computed once per prompt; the prompt keeps its first ``len(P)``
  columns and every token after it (any depth of the tree) gets ``s + (v - len(P))`` on all three
  rows, where ``s`` is the dummy token's position and ``v`` the token's 1-D virtual position. Text
  after ``P`` advances all three rows by one per token, so this equals the model's rope index of
  ``[P; R_i]`` alone.

The M-RoPE arithmetic and the model facts it needs are :mod:`flexgroup.data.mrope`'s.
The model is only duck-typed (``get_rope_index``, ``config.image_token_id`` ...): no transformers
import here.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

import torch

from .batch import GroupedBatch, group_parts
from ..layout.checks import check_loss_masks, check_sequences, token_ids
from ..layout.trie import build_trie
from ..layout import Layout
from .mrope import (VISION_KEYS, MRopeIndex, grouped_mrope_position_ids,
                    normalize_vision, same_vision, split_rows, vision_entries, visual_item_keys)

__all__ = ["MultimodalGroupedBatch"]

Tensor = torch.Tensor

class MultimodalGroupedBatch(GroupedBatch):
    """A :class:`GroupedBatch` whose prompts carry images / videos (Qwen-VL M-RoPE models).

    Build with :meth:`from_groups`, :meth:`from_padded` or :meth:`from_sequences`; use as a ``GroupedBatch``:
    ``model(**batch.model_inputs())``, ``batch.logprobs(logits)``, ``batch.response_mask``.
    Trees with images in any turn (a trajectory whose tool replies return screenshots): :meth:`from_sequences`.

    Attributes (beside GroupedBatch's):
        mrope_position_ids: LongTensor ``[3, L]`` (``position_ids`` stays the 1-D virtual positions).
        vision_inputs: dict of the concatenated visual tensors of all prompts, in packing order.
        sequence_vision: per output row, the visual inputs of that whole sequence alone (its prompt's, or
            the sequence's own for :meth:`from_sequences`; None for text only): what
            :meth:`sequence_inputs` gives the per-sequence baseline.
    """

    def __init__(self, layout: Layout, input_ids: Tensor, paths: Sequence[Tensor], loss_masks: Sequence[Tensor],
                 skip: Sequence[int] | None = None, width: int | None = None, *, rope: MRopeIndex | None = None,
                 mrope_position_ids: Tensor | None = None, vision_inputs: Mapping[str, Tensor] | None = None,
                 sequence_vision: Sequence[Mapping[str, Tensor] | None] | None = None):
        """Low-level constructor (use the ``from_*`` classmethods); GroupedBatch's arguments plus
        ``rope``, ``mrope_position_ids`` [3, L], the packed ``vision_inputs`` and each output row's own
        ``sequence_vision``."""
        if rope is None or mrope_position_ids is None:
            raise TypeError("MultimodalGroupedBatch: build it with from_groups(..., model=model), "
                            "from_padded(..., model=model) or from_sequences(..., model=model)")
        super().__init__(layout, input_ids, paths, loss_masks, skip=skip, width=width)
        self.rope: MRopeIndex = rope
        self.mrope_position_ids: Tensor = mrope_position_ids
        self.vision_inputs: dict[str, Tensor] = dict(vision_inputs or {})
        self.sequence_vision: list[dict[str, Tensor] | None] = (
            [dict(v) if v else None for v in sequence_vision] if sequence_vision is not None
            else [None] * self.num_responses)

    @classmethod
    def _groups(cls, prompts: list[Tensor], responses: list[list[Tensor]], order: Sequence[int] | None = None,
                width: int | None = None, *, rope: MRopeIndex, vision: Sequence[Mapping | None] | None = None
                ) -> "MultimodalGroupedBatch":
        """One two-level tree per group (images in prompts only); ``order`` as in ``group_parts``."""
        vision = vision_entries(vision, prompts, rope, "prompt", "MultimodalGroupedBatch")
        placeholders = (rope.image_token_id, rope.video_token_id)
        k = 0
        for g, rs in enumerate(responses):
            for r in rs:
                bad = [t for t in placeholders if bool((r == t).any())]
                if bad:
                    raise ValueError(
                        f"response {k} (prompt {g}) contains visual placeholder token id {bad[0]}: with "
                        "from_groups / from_padded images and videos belong in prompts; for images in later "
                        "turns pass whole sequences to MultimodalGroupedBatch.from_sequences")
                k += 1
        kept = [normalize_vision(v, g, p, rope) for g, (p, v) in enumerate(zip(prompts, vision))]
        layout, input_ids, paths, masks, skip = group_parts(prompts, responses, order)
        mrope = grouped_mrope_position_ids(layout, [rope.prompt_positions(p, v) for p, v in zip(prompts, kept)])
        vision_inputs = {}
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            parts = [v[key] for v in kept if key in v]
            if parts:
                vision_inputs[key] = torch.cat(parts)
        packed_group = [g for g, rs in enumerate(responses) for _ in rs]  # group of the k-th packed response
        rows = range(len(packed_group)) if order is None else order
        sequence_vision: list = [None] * len(packed_group)
        for k, row in enumerate(rows):
            sequence_vision[row] = kept[packed_group[k]]
        return cls(layout, input_ids, paths, masks, skip, width, rope=rope, mrope_position_ids=mrope,
                   vision_inputs=vision_inputs, sequence_vision=sequence_vision)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_groups(cls, prompts: Sequence[Tensor], responses: Sequence[Sequence[Tensor]], *, model: Any,
                    vision: Sequence[Mapping | None] | None = None) -> "MultimodalGroupedBatch":
        """Pack groups whose prompts carry images / videos.

        Args:
            prompts: list of 1-D LongTensors; visual placeholders (``config.image_token_id`` /
                ``video_token_id``) already expanded, as the processor returns them.
            responses: one list of 1-D LongTensors per prompt (text only).
            model: the vision-language model (its ``get_rope_index`` and config are used).
            vision: one entry per prompt, ``None`` for a text-only prompt, else a mapping with
                ``pixel_values`` [patches_g, D] + ``image_grid_thw`` [n_img, 3] and/or
                ``pixel_values_videos`` + ``video_grid_thw`` [n_vid, 3] (+ ``second_per_grid_ts``
                [n_vid] for Qwen2.5-VL). A processor output may be passed as is, per prompt, or one mapping for
                all prompts (every prompt's items in order), split by each prompt's placeholders.
        """
        prompts, responses = list(prompts), [list(r) for r in responses]
        GroupedBatch.from_groups(prompts, responses)  # the text batch's validation and messages
        ps = [token_ids(p, f"prompt {g}") for g, p in enumerate(prompts)]
        rs = [[token_ids(x, "response") for x in r] for r in responses]
        return cls._groups(ps, rs, rope=MRopeIndex.from_model(model), vision=vision)

    @classmethod
    def from_padded(cls, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                    group_size: int | None = None, group_ids: Sequence | Tensor | None = None, *, model: Any,
                    pixel_values: Tensor | None = None, image_grid_thw: Tensor | None = None,
                    pixel_values_videos: Tensor | None = None, video_grid_thw: Tensor | None = None,
                    second_per_grid_ts: Tensor | None = None) -> "MultimodalGroupedBatch":
        """Pack trainer tensors (one row per response) whose prompts carry images / videos.

        Args:
            prompt_ids, prompt_mask, completion_ids, completion_mask, group_size, group_ids: as in
                :meth:`GroupedBatch.from_padded`.
            model: the vision-language model.
            pixel_values [patches, D], image_grid_thw [n_img, 3], pixel_values_videos,
                video_grid_thw [n_vid, 3], second_per_grid_ts [n_vid]: the visual inputs of all rows,
                row after row (as a trainer collates them; every row carries its own copy).

        Members of a group must have identical prompt tokens and identical visual inputs (ValueError
        naming the group otherwise). The vision tower then runs once per group.
        """
        base = GroupedBatch.from_padded(prompt_ids, prompt_mask, completion_ids, completion_mask,
                                        group_size=group_size, group_ids=group_ids)
        rope = MRopeIndex.from_model(model)
        pid, pm = torch.as_tensor(prompt_ids).cpu(), torch.as_tensor(prompt_mask).cpu().bool()
        cid, cm = torch.as_tensor(completion_ids).cpu(), torch.as_tensor(completion_mask).cpu().bool()
        rows_vision = split_rows([pid[i][pm[i]] for i in range(pid.shape[0])], rope, {
            "pixel_values": pixel_values, "image_grid_thw": image_grid_thw,
            "pixel_values_videos": pixel_values_videos, "video_grid_thw": video_grid_thw,
            "second_per_grid_ts": second_per_grid_ts})
        # the base batch packed groups in order of first appearance, members in row order
        order = torch.argsort(base.group_of_response, stable=True).tolist()
        lay = base.layout
        prompts = [base.input_ids[lay.starts[r]:lay.starts[r] + lay.lengths[r]] for r in lay.roots]
        responses: list[list[Tensor]] = [[] for _ in prompts]
        vision: list[dict | None] = [None] * len(prompts)
        first: list[int] = [-1] * len(prompts)
        for i in order:
            g = int(base.group_of_response[i])
            responses[g].append(cid[i][cm[i]].long())
            if first[g] < 0:
                first[g], vision[g] = i, rows_vision[i]
            elif not same_vision(vision[g], rows_vision[i]):
                raise ValueError(f"from_padded: rows {first[g]} and {i} are in one group but carry different visual "
                                 "inputs: members of a group must share the prompt's images and videos")
        return cls._groups(prompts, responses, order, cid.shape[1], rope=rope, vision=vision)

    @classmethod
    def from_sequences(cls, sequences: Sequence[Tensor], loss_masks: Sequence[Tensor] | None = None, *, model: Any,
                       vision: Sequence[Mapping | None] | None = None) -> "MultimodalGroupedBatch":
        """Vision-language trees: whole sequences with images / videos anywhere (e.g. screenshots in tool
        replies of later turns), every common prefix shared as in :meth:`GroupedBatch.from_sequences`.

        Two sequences share a token only if they agree on every earlier token *and* every earlier
        image: a placeholder token's trie key is (token id, the item's pixels, grid and timing, its index
        in the item), so equal placeholder ids with different pixels are never merged. The M-RoPE ids of
        each sequence are the model's own rope index of that sequence alone (a function of its path; a
        shared node gets the same ids from every sequence through it, checked), and each visual item
        occurrence in the packed row is encoded once, its features filling its placeholders.

        Args:
            sequences, loss_masks: as in :meth:`GroupedBatch.from_sequences` (placeholders expanded, as
                the processor returns them).
            model: the vision-language model.
            vision: one entry per sequence (``None`` for text only): the visual inputs of that whole
                sequence, in order (``pixel_values`` + ``image_grid_thw``, ``pixel_values_videos`` +
                ``video_grid_thw``, ``second_per_grid_ts``), as the processor returns them for it; or one
                mapping for all sequences (their items in order), split by each sequence's placeholders.
        """
        seqs = check_sequences(sequences)
        masks = check_loss_masks(loss_masks, seqs)
        rope = MRopeIndex.from_model(model)
        vision = vision_entries(vision, seqs, rope, "sequence", "MultimodalGroupedBatch.from_sequences")
        kept = [normalize_vision(v, i, s, rope, "sequence") for i, (s, v) in enumerate(zip(seqs, vision))]
        keys, items, _ = visual_item_keys(seqs, kept, rope)
        trie = build_trie(keys)
        layout = Layout.tree(trie.parents, trie.lengths)
        src = trie.source
        input_ids = trie.packed_row(seqs)
        mrope = torch.full((3, layout.num_tokens), -1, dtype=torch.long)
        for i, (s, v, path) in enumerate(zip(seqs, kept, trie.paths)):
            pos = rope.prompt_positions(s, v)[:, : s.numel()]
            seen = mrope[:, path]
            if bool(((seen >= 0) & (seen != pos)).any()):
                raise RuntimeError(f"sequence {i}: the model's M-RoPE ids of a shared prefix differ between "
                                   f"sequences ({rope.model_type}): the prefix cannot be shared exactly; please report it")
            mrope[:, path] = pos
        # each visual item occurrence in packed order, as the model scatters features into placeholders
        vision_inputs: dict[str, list[Tensor]] = {}
        current: dict[int, tuple[int, int]] = {}
        for i, t in src.tolist():
            key = keys[i][t]
            if not isinstance(key, tuple):
                continue
            tok, iid, o = key
            if o == 0:  # the j-th item of its kind in sequence i starts here
                j = sum(1 for x in keys[i][:t] if isinstance(x, tuple) and x[0] == tok and x[2] == 0)
                for k, x in items[i][tok][j].items():
                    vision_inputs.setdefault(k, []).append(x)
            elif current.get(tok) != (iid, o - 1):
                raise ValueError(f"sequence {i}: the placeholders of one visual item are split by another item's "
                                 "in the packed row (a branch inside an image or video): this tree cannot be packed "
                                 "exactly; give such sequences separate visual items or pack them in separate batches")
            current[tok] = (iid, o)
        packed = {k: torch.cat(x) for k, x in vision_inputs.items() if k != "second_per_grid_ts"}
        return cls(layout, input_ids, list(trie.paths), masks, rope=rope, mrope_position_ids=mrope,
                   vision_inputs=packed, sequence_vision=kept)

    @classmethod
    def _refuse(cls, how: str):
        raise NotImplementedError(
            f"MultimodalGroupedBatch.{how} is not implemented: pass whole sequences with each sequence's own "
            "visual inputs to MultimodalGroupedBatch.from_sequences(sequences, loss_masks, model=model, vision=...)")

    @classmethod
    def from_padded_sequences(cls, *args, **kwargs):
        cls._refuse("from_padded_sequences")

    @classmethod
    def from_layout(cls, *args, **kwargs):
        cls._refuse("from_layout")

    # ------------------------------------------------------------------ model side
    def model_inputs(self, device: torch.device | str | None = None, *, needed_logits_only: bool = False,
                     shard=None) -> dict:
        """Keyword arguments for the patched model: ``model(**batch.model_inputs())``.

        Returns GroupedBatch's ``input_ids`` [1, L], ``attention_mask`` (the layout carrier) and
        ``use_cache=False``; ``position_ids`` ``[3, 1, L]`` (M-RoPE); and the concatenated visual
        tensors of all prompts (``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``,
        ``video_grid_thw``; only those present).

        ``shard=group`` (a model patched with ``sequence_parallel=group``): this rank's part of the padded
        row, as :meth:`GroupedBatch.model_inputs` gives it, with :meth:`logprobs` ``(logits, shard=group)``
        reading this rank's tokens; see :meth:`_sharded_inputs` for the visual inputs.
        """
        from .carrier import tag_position_ids

        if shard is not None:
            return self._sharded_inputs(torch.device(device) if device is not None else torch.device("cpu"),
                                        needed_logits_only, shard)
        out = super().model_inputs(device, needed_logits_only=needed_logits_only)
        dev = out["input_ids"].device
        out["position_ids"] = tag_position_ids(self.mrope_position_ids.to(dev, copy=True)[:, None], self.layout)
        for k, v in self.vision_inputs.items():
            out[k] = v.to(dev, copy=True)      # copies, as every tensor here: never the batch's own
        return out

    def _visual_items(self) -> list[tuple[int, int, dict[str, Tensor]]]:
        """Per visual item of the packed row, in order: ``(first placeholder, last + 1, its inputs)``."""
        items = []
        for tok, pix, grid in ((self.rope.image_token_id, "pixel_values", "image_grid_thw"),
                               (self.rope.video_token_id, "pixel_values_videos", "video_grid_thw")):
            if grid not in self.vision_inputs:
                continue
            g = self.vision_inputs[grid]
            where = torch.nonzero(self.input_ids == tok)[:, 0].tolist()
            rows = [0] + g.prod(-1).cumsum(0).tolist()
            at = 0
            for j, n in enumerate(self.rope.tokens_of(g)):
                items.append((where[at], where[at + n - 1] + 1,
                              {pix: self.vision_inputs[pix][rows[j]:rows[j + 1]], grid: g[j:j + 1]}))
                at += n
        return items

    def _sharded_inputs(self, device: torch.device, needed_logits_only: bool, group) -> dict:
        """This rank's part of the padded row (Ulysses sequence parallelism), for the vision-language model.

        The decoder runs on this rank's slice ``[start, stop)`` of ``Lp / W`` tokens (``position_ids``
        ``[3, 1, Lp / W]``, the M-RoPE ids of the slice), exactly as for a text batch. The visual features of
        a slice come from whole images and videos: the vision tower runs on each item whose placeholders
        meet the slice (an item split by a rank boundary runs on both ranks; each rank keeps the features of
        its own placeholders, so summed over ranks every feature row gets its gradient once), and
        ``input_ids`` is the *window* ``[1, n_w]`` from the first placeholder of such an item to the last
        (at least the slice). The model embeds the window and scatters the features; the language model's
        sequence-parallel hook (:mod:`flexgroup.patches.sequence_parallel`) keeps the slice's rows of it
        (and, for Qwen3-VL, the slice's rows of the deepstack features and of their placeholder mask).
        """
        from . import sharding
        from .carrier import GroupedMask, tag_position_ids

        if self.rope.model_type not in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
            raise NotImplementedError(
                f"MultimodalGroupedBatch.model_inputs(shard=...) with {self.rope.model_type}: sequence parallelism x "
                "this vision-language model is not implemented (how its visual features reach the decoder is only "
                "known for Qwen2-VL, Qwen2.5-VL and Qwen3-VL); run it unsharded (model_inputs() without shard=)")
        # the fingerprint holds every item (a rank gets those its slice meets) and the M-RoPE ids (video timing)
        sh = sharding.row_shard(self.layout, self.input_ids, group, loss_masks=self.response_mask,
                                visual=(self.vision_inputs, self.mrope_position_ids))
        sharding.note_inputs(self, (sh.rank, sh.world) if sh.world > 1 else None)  # logprobs then needs shard=
        lo, hi = sh.start, sh.stop
        meet = [(a, b, x) for a, b, x in self._visual_items() if a < hi and b > lo]
        w0, w1 = min([lo] + [a for a, _, _ in meet]), max([hi] + [b for _, b, _ in meet])
        ids = sharding.padded_tensor(self.input_ids, sh)
        pad = sh.layout.position_ids[self.num_tokens:]
        mrope = torch.cat([self.mrope_position_ids, pad.expand(3, -1)], 1)[:, lo:hi]     # [3, Lp / W]
        pos = tag_position_ids(mrope.to(device)[:, None], sh.layout)
        visual = (ids == self.rope.image_token_id) | (ids == self.rope.video_token_id)
        # where the slice sits in the embedded window, and (Qwen3-VL deepstack features, one row per visual
        # token of the window in order) the window's visual tokens before the slice and inside it
        pos._flexgroup_window = (lo - w0, w1 - w0, int(visual[w0:lo].sum()), int(visual[lo:hi].sum()))
        out = {"input_ids": ids[w0:w1].to(device, copy=True)[None], "position_ids": pos,
               "attention_mask": GroupedMask(sh.layout, device, sh, self.sequence_ends), "use_cache": False}
        for _, _, x in meet:
            for k, v in x.items():
                out.setdefault(k, []).append(v)
        for k in [k for k in out if k in VISION_KEYS]:
            out[k] = torch.cat(out[k]).to(device)
        if needed_logits_only:
            out["logits_to_keep"] = sharding.rank_rows(self, group)[0].to(device, copy=True)
        return out

    def sequence_inputs(self, i: int, device: torch.device | str | None = None) -> dict:
        """Keyword arguments beside ``input_ids`` [1, n_i] that run sequence ``i`` alone through the stock
        model: its own visual inputs (``pixel_values`` ... ``second_per_grid_ts``, those it has) and, where
        the model's rope index takes them, its ``mm_token_type_ids`` [1, n_i] (0 text, 1 image, 2 video);
        where it does not (transformers 4.x), an all-ones ``attention_mask`` [1, n_i]: without a mask those
        versions take a sequence with images for a packed one and split it at every image."""
        out = {k: x.to(device, copy=True) for k, x in (self.sequence_vision[i] or {}).items()}
        if "mm_token_type_ids" in inspect.signature(self.rope.rope_index).parameters:
            out["mm_token_type_ids"] = self.rope.token_types(self.input_ids[self.paths[i]])[None].to(device)
        else:
            out["attention_mask"] = torch.ones(1, len(self.paths[i]), dtype=torch.long, device=device)
        return out

    def __repr__(self) -> str:
        n_img = len(self.vision_inputs.get("image_grid_thw", ()))
        n_vid = len(self.vision_inputs.get("video_grid_thw", ()))
        return (f"MultimodalGroupedBatch({len(self.layout.roots)} groups, {self.num_responses} responses, "
                f"{self.num_tokens} tokens, {n_img} images, {n_vid} videos)")
