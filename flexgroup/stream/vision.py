"""Streaming of vision-language trees: images encoded once, their features and M-RoPE ids fed to each chunk.

:func:`flexgroup.stream_backward` / :func:`flexgroup.stream_logprobs` with ``vision=`` (one entry per
sequence, as :meth:`flexgroup.MultimodalGroupedBatch.from_sequences` takes them) on a Qwen2-VL,
Qwen2.5-VL, Qwen3-VL or Qwen3.5 (hybrid: its Gated DeltaNet state is forked and kept across chunks as in
text streaming) model. :class:`StreamVision` does what the composite model's forward would do
for a packed row, once per call instead of once per forward:

- **the vision tower runs once per distinct visual item** (an image or video whose pixels, grid and
  timing are equal is one item, however many sequences and trees show it), watched like a grouped forward (a
  random op in it is refused: :func:`flexgroup.patches.watched_outside_forward`): ``get_image_features`` /
  ``get_video_features`` of the composite model over every distinct item, giving the features
  ``F`` [R, H] (R merged placeholder tokens in all, item after item) and, on Qwen3-VL, each deepstack
  level's ``D_l`` [R, H]. The streamed chunks read detached leaves of them (requiring grad when training);
  after the last chunk's backward, :meth:`StreamVision.backward` runs the tower's backward once with the
  gradients the chunks accumulated in the leaves, so the tower's parameters get exactly the gradient of
  the unchunked batch;
- **trie keys**: a placeholder token's key is its item and index in it
  (:func:`flexgroup.data.mrope.visual_item_keys`): sequences share a node only if they showed the same images;
- **positions**: each trie token gets the model's own 3-row M-RoPE ids of any sequence through it (the
  rope index of that sequence alone, checked equal between sequences); a chunk passes ``[3, 1, Q]``;
- **each chunk** embeds its token ids, scatters the feature rows of its placeholder tokens into them
  (``masked_scatter``, as the composite model does; an item may be split across chunks: every token
  knows its row of ``F``) and calls the model with ``inputs_embeds``; on Qwen3-VL a forward pre-hook on
  the language model passes the chunk's ``visual_pos_masks`` [1, Q] and deepstack rows, which the
  composite model computes only from ``pixel_values``.

Everything else -- kept keys and values of shared prefixes, log-prob bookkeeping, pending backwards, the
sharded forwards of sequence parallelism -- is the text streaming's (:mod:`flexgroup.stream`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Mapping, Sequence

import torch

from ..data.mrope import MRopeIndex, normalize_vision, vision_entries, visual_item_keys

__all__ = ["StreamVision", "SUPPORTED", "streams_vision"]

Tensor = torch.Tensor
#: model types whose visual features and M-RoPE ids streaming carries across chunks
SUPPORTED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")   # qwen3_5: the Gated DeltaNet hybrid VL model
_TOWER = {"image": ("get_image_features", "pixel_values", "image_grid_thw"),
          "video": ("get_video_features", "pixel_values_videos", "video_grid_thw")}


def _base(model):
    from ..patches import base_model

    return base_model(model, "stream_backward")


def streams_vision(model: torch.nn.Module, vision) -> bool:
    """Whether a streamed call on ``model`` takes the vision path: ``vision=`` given (checked), or a
    supported vision-language model (its text-only trees then get the model's M-RoPE ids as well)."""
    config = _base(model).config
    if vision is None:
        return getattr(config, "vision_config", None) is not None and config.model_type in SUPPORTED
    if getattr(config, "vision_config", None) is None:
        raise ValueError(f"flexgroup.stream_backward: vision= was given but {type(_base(model)).__name__} "
                         f"({config.model_type}) has no vision tower (no config.vision_config): streaming x "
                         "vision-language needs a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3.5 model; drop vision= for a "
                         "text model")
    if config.model_type not in SUPPORTED:
        raise NotImplementedError(
            f"flexgroup.stream_backward: streaming x vision-language on {config.model_type} is not supported: how its "
            f"visual features and position ids reach the decoder is known only for {', '.join(SUPPORTED)}, so its "
            "chunks could not be made exact. Run the batch as MultimodalGroupedBatch.from_sequences rows instead")
    return True


class StreamVision:
    """The visual side of one streamed call.

    Args:
        model: the patched Qwen-VL model (or its PEFT wrapper).
        sequences: N checked 1-D id tensors (placeholders expanded, as the processor returns them).
        vision: None or N entries (None for text only), each as ``MultimodalGroupedBatch.from_sequences``
            takes them: ``pixel_values`` [patches, D] + ``image_grid_thw`` [n_img, 3], ``pixel_values_videos``
            + ``video_grid_thw`` [n_vid, 3] (+ ``second_per_grid_ts`` [n_vid]).

    Attributes:
        keys: per sequence, the trie key of each token (for :func:`flexgroup.stream.plan.plan_stream`).
        distinct: per item id, ``(kind, item inputs)``.
    """

    def __init__(self, model: torch.nn.Module, sequences: Sequence[Tensor], vision: Sequence[Mapping | None] | None):
        self.base = _base(model)
        self.rope = MRopeIndex.from_model(model)
        if vision is None:
            held = [i for i, s in enumerate(sequences)
                    if bool(((s == self.rope.image_token_id) | (s == self.rope.video_token_id)).any())]
            if held:
                raise ValueError(
                    f"flexgroup.stream_backward: sequence {held[0]} holds image/video placeholder tokens but vision= "
                    f"was not given: streaming a vision-language tree needs each sequence's visual inputs, "
                    "vision=[{'pixel_values': ..., 'image_grid_thw': ...} or None per sequence]")
        vision = vision_entries(vision, sequences, self.rope, "sequence", "flexgroup.stream_backward")
        self.kept = [normalize_vision(v, i, s, self.rope, "sequence")
                     for i, (s, v) in enumerate(zip(sequences, vision))]
        self.sequences = list(sequences)
        self.keys, _, self.distinct = visual_item_keys(self.sequences, self.kept, self.rope)
        sizes = [sum(self.rope.tokens_of(item[_TOWER[kind][2]])) for kind, item in self.distinct]
        self.offsets = [0] + torch.tensor(sizes, dtype=torch.long).cumsum(0).tolist()  # item id -> first row of F
        self.features: list[Tensor] = []   # F and the deepstack levels, graph attached (training)
        self.leaves: list[Tensor] = []     # their detached leaves, read by the chunks
        self.mrope: Tensor | None = None   # [3, L] per trie token
        self.rows: Tensor | None = None    # [L] row of F per trie token, -1 for text

    # ------------------------------------------------------------------ per call
    def bind(self, trie) -> None:
        """Per trie token (``trie`` of ``plan_stream(keys=self.keys)``): its M-RoPE ids and feature row."""
        L = trie.num_tokens
        self.mrope = torch.full((3, L), -1, dtype=torch.long)
        for i, (s, v, path) in enumerate(zip(self.sequences, self.kept, trie.paths)):
            pos = self.rope.prompt_positions(s, v)[:, : s.numel()]
            seen = self.mrope[:, path]
            if bool(((seen >= 0) & (seen != pos)).any()):
                raise RuntimeError(f"flexgroup.stream_backward: sequence {i}: the model's M-RoPE ids of a shared "
                                   f"prefix differ between sequences ({self.rope.model_type}): the prefix cannot be "
                                   "shared exactly; please report it")
            self.mrope[:, path] = pos
        self.rows = torch.full((L,), -1, dtype=torch.long)
        for t, (i, j) in enumerate(trie.source.tolist()):
            key = self.keys[i][j]
            if isinstance(key, tuple):
                _, iid, o = key
                self.rows[t] = self.offsets[iid] + o

    def encode(self, device: torch.device) -> None:
        """Run the tower once over every distinct item (graph attached when grad is enabled)."""
        if not self.distinct:
            return
        from ..patches import watched_outside_forward
        from ..patches.qwen_vl import composite_model

        inner = composite_model(self.base)
        per_item: dict[int, list[Tensor]] = {}
        for kind, (fn, pix, grid) in _TOWER.items():
            ids = [iid for iid, (k, _) in enumerate(self.distinct) if k == kind]
            if not ids:
                continue
            pv = torch.cat([self.distinct[i][1][pix] for i in ids]).to(device)
            gt = torch.cat([self.distinct[i][1][grid] for i in ids]).to(device)
            # the tower runs outside the model's watched forward: a draw in it (dropout, noise) is refused as there
            with watched_outside_forward(self.base, inner, f"flexgroup.stream_backward: {type(self.base).__name__}"):
                out = getattr(inner, fn)(pv, gt)
            main, deep = self._split(out, [self.offsets[i + 1] - self.offsets[i] for i in ids])
            for n, iid in enumerate(ids):
                per_item[iid] = [main[n]] + [d[n] for d in deep]
        levels = {len(v) for v in per_item.values()}
        if len(levels) != 1:  # pragma: no cover - one tower gives one structure
            raise RuntimeError("flexgroup.stream_backward: the tower's image and video features differ in deepstack "
                               "levels; please report it")
        self.features = [torch.cat([per_item[i][lv] for i in range(len(self.distinct))]) for lv in range(levels.pop())]
        self.leaves = [f.detach().requires_grad_(f.requires_grad) for f in self.features]

    def _split(self, out, sizes: list[int]) -> tuple[list[Tensor], list[list[Tensor]]]:
        """The tower's output for items of ``sizes`` placeholder tokens as (per-item features [n, H], per
        deepstack level per-item features)."""
        if hasattr(out, "pooler_output"):          # transformers 5: a ModelOutput
            main, deep = out.pooler_output, getattr(out, "deepstack_features", None) or []
        elif self.rope.model_type == "qwen3_vl" and isinstance(out, tuple) and len(out) == 2 \
                and isinstance(out[1], list):      # transformers 4.57: (features, deepstack)
            main, deep = out
        else:                                      # transformers 4.5x: the per-item features
            main, deep = out, []
        split = lambda x: torch.split(x, sizes) if isinstance(x, Tensor) else list(x)  # noqa: E731
        main, deep = split(main), [split(d) for d in deep]
        got = [int(x.shape[0]) for x in main]
        if got != sizes:
            raise RuntimeError(f"flexgroup.stream_backward: the vision tower returned feature blocks of {got} rows for "
                               f"items of {sizes} placeholder tokens ({self.rope.model_type}); please report it")
        return list(main), [list(d) for d in deep]

    def backward(self) -> None:
        """The tower's one backward: its features with the gradients the chunks accumulated in their leaves."""
        pairs = [(f, leaf.grad) for f, leaf in zip(self.features, self.leaves)
                 if f.requires_grad and leaf.grad is not None]
        if pairs:
            torch.autograd.backward([f for f, _ in pairs], [g for _, g in pairs])
        self.features, self.leaves = [], []

    # ------------------------------------------------------------------ per chunk
    def inputs(self, tokens: Tensor, ids: Tensor, positions: Tensor, device: torch.device
               ) -> tuple[Tensor, Tensor, tuple | None]:
        """A forward's ``inputs_embeds`` [1, m, H], M-RoPE ids [3, 1, m] and deepstack inputs.

        Args:
            tokens: LongTensor [m], the trie row of each token (-1: padding of a sharded chunk).
            ids: LongTensor [m], their token ids.
            positions: LongTensor [m], 1-D positions, used for the padding only.

        Returns:
            ``(inputs_embeds, position_ids, deep)``; ``deep`` is ``(visual_pos_masks [1, m], [rows [v, H]
            per level])`` on Qwen3-VL when the forward holds ``v > 0`` visual tokens, else None.
        """
        real = tokens >= 0
        at = tokens.clamp(min=0)
        rows = torch.where(real, self.rows[at], -1)                       # [m] row of F, -1 for text / padding
        pos = torch.where(real, self.mrope[:, at], positions.expand(3, -1))
        emb = self.base.get_input_embeddings()(ids.to(device)[None])      # [1, m, H]
        vis = rows >= 0
        deep = None
        if bool(vis.any()):
            sel = rows[vis].to(device)
            mask = vis.to(device)[None, :, None]
            emb = emb.masked_scatter(mask, self.leaves[0].index_select(0, sel).to(emb.device, emb.dtype))
            if len(self.leaves) > 1:
                deep = (vis.to(device)[None], [d.index_select(0, sel) for d in self.leaves[1:]])
        return emb, pos.to(device)[:, None], deep

    @contextmanager
    def deepstack(self, deep: tuple | None):
        """While the model runs: hand Qwen3-VL's language model the chunk's deepstack inputs (a pre-hook)."""
        if deep is None:
            yield
            return
        from ..patches.qwen_vl import language_model

        def hook(module, args, kwargs):
            kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"] = deep
            return args, kwargs

        handle = language_model(self.base).register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def forward(self, model: torch.nn.Module, tokens: Tensor, ids: Tensor, positions: Tensor, layout, mask,
                keep: Tensor, device: torch.device) -> Tensor:
        """Run one forward of ``tokens`` (as in :meth:`inputs`) with ``mask`` (its StreamMask); the logits
        [K, V] of its local rows ``keep`` [K]."""
        from ..data.carrier import tag_position_ids

        emb, pos, deep = self.inputs(tokens, ids, positions, device)
        with self.deepstack(deep):
            out = model(inputs_embeds=emb, position_ids=tag_position_ids(pos, layout), attention_mask=mask,
                        use_cache=False, logits_to_keep=keep.to(device))
        logits = out.logits[0]
        if logits.shape[0] != keep.numel():  # transformers 4.56's Qwen2-VL ignores logits_to_keep
            logits = logits.index_select(0, keep.to(logits.device))
        return logits
