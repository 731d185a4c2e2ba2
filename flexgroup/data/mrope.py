"""M-RoPE for packed rows: the Qwen-VL model facts, 3-row position ids, per-item visual inputs.

- :class:`MRopeIndex`: what a multimodal batch reads from a live model (its ``get_rope_index``,
  placeholder token ids, spatial merge size) and the rope index of ``[prompt; dummy text token]``;
- :func:`grouped_mrope_position_ids`: ``[3, L]`` ids of a packed row, exact per root-to-leaf sequence
  (the prompt keeps its own columns; every later token gets ``s + (v - len(P))`` on all three rows);
- :func:`normalize_vision`, :func:`split_rows`, :func:`same_vision`: visual inputs checked against
  placeholder tokens, split per trainer row, compared between rows;
- :func:`visual_item_keys`: the trie keys of sequences with visual items (a placeholder keyed by its item).

Used by :mod:`flexgroup.data.multimodal`. The model is only duck-typed: no transformers import here.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ..reference.model_checks import unwrap
from ..layout import Layout

__all__ = ["MRopeIndex", "grouped_mrope_position_ids", "VISION_KEYS", "normalize_vision", "split_rows",
           "same_vision", "visual_item_keys", "vision_entries"]

Tensor = torch.Tensor

#: per-prompt visual inputs accepted (the keys Qwen-VL processors return)
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
# keys a processor returns beside the visual ones; they describe the prompt, which is given separately
_IGNORED_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")


def grouped_mrope_position_ids(layout: Layout, root_positions: Sequence[Tensor]) -> Tensor:
    """3-row M-RoPE ids of a packed row, exact per root-to-leaf sequence.

    Args:
        layout: the packed layout (roots are prompts; every other segment is text).
        root_positions: one LongTensor ``[3, len(root) + 1]`` per root in ``layout.roots`` order: the
            model's rope index of the root's tokens followed by one dummy text token.

    Returns:
        LongTensor ``[3, L]``.
    """
    if len(root_positions) != len(layout.roots):
        raise ValueError(f"{len(root_positions)} root position tensors for {len(layout.roots)} roots")
    seg = layout.seg_id
    root_of = torch.tensor(layout.component, dtype=torch.long)[seg]       # [L] root segment of each token
    v = layout.position_ids                                                # [L] 1-D virtual positions
    out = torch.empty(3, layout.num_tokens, dtype=torch.long)
    for r, pos in zip(layout.roots, root_positions):
        n, a = layout.lengths[r], layout.starts[r]
        pos = torch.as_tensor(pos).long().cpu().reshape(3, -1)
        if pos.shape[1] != n + 1:
            raise ValueError(f"root segment {r} has {n} tokens but its rope index has {pos.shape[1]} columns "
                             f"(expected {n} + 1 dummy)")
        s = pos[:, n]
        if not bool((s == s[0]).all()):
            raise ValueError(f"the dummy text token after root segment {r} got non-text M-RoPE ids {s.tolist()}")
        out[:, a:a + n] = pos[:, :n]
        after = (root_of == r) & (seg != r)
        out[:, after] = s[0] + (v[after] - n)
    return out


@dataclass(frozen=True)
class MRopeIndex:
    """The model facts a multimodal batch needs, read from a live model.

    Attributes:
        rope_index: the model's ``get_rope_index`` (bound method).
        image_token_id, video_token_id: placeholder token ids (``config.image_token_id`` ...).
        merge: ``vision_config.spatial_merge_size``; an image of grid ``(t, h, w)`` fills
            ``t * h * w // merge**2`` placeholder tokens.
        model_type: ``config.model_type`` (for messages).
        vision_ids: placeholder and vision start/end token ids (never used as the dummy token).
    """

    rope_index: Callable
    image_token_id: int
    video_token_id: int
    merge: int
    model_type: str
    vision_ids: tuple[int, ...] = ()

    @classmethod
    def from_model(cls, model: Any) -> "MRopeIndex":
        """Read the facts from a Qwen-VL model: ``*ForConditionalGeneration``, its ``.model``, or PEFT-wrapped."""
        base = unwrap(model)
        fn = None
        for m in (base, getattr(base, "model", None)):
            if m is not None and callable(getattr(m, "get_rope_index", None)):
                fn = m.get_rope_index
                break
        config = getattr(base, "config", None)
        vision = getattr(config, "vision_config", None)
        if fn is None or config is None or vision is None or getattr(config, "image_token_id", None) is None:
            raise TypeError(
                f"MultimodalGroupedBatch needs a vision-language model with get_rope_index and "
                f"config.image_token_id / vision_config (Qwen2-VL, Qwen2.5-VL, Qwen3-VL); got {type(base).__name__}"
            )
        ids = [getattr(config, k, None) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                   "vision_end_token_id")]
        return cls(fn, int(config.image_token_id), int(config.video_token_id), int(vision.spatial_merge_size),
                   str(getattr(config, "model_type", type(base).__name__)), tuple(int(i) for i in ids if i is not None))

    def token_types(self, ids: Tensor) -> Tensor:
        """IntTensor [n]: 0 text, 1 image placeholder, 2 video placeholder."""
        return (ids == self.image_token_id).int() + 2 * (ids == self.video_token_id).int()

    def tokens_of(self, grid: Tensor | None) -> list[int]:
        """Placeholder tokens filled by each item of a grid ``[n, 3]``."""
        return [] if grid is None else (grid.prod(-1) // self.merge ** 2).tolist()

    def prompt_positions(self, prompt: Tensor, vision: Mapping[str, Tensor]) -> Tensor:
        """LongTensor ``[3, len(prompt) + 1]``: the model's rope index of ``[prompt; dummy text token]``."""
        # any text id works (positions depend on token types only); avoid the vision ids older
        # transformers scan for (vision_start followed by image/video)
        dummy = next(t for t in range(len(self.vision_ids) + 1) if t not in self.vision_ids)
        ids = torch.cat([prompt, prompt.new_tensor([dummy])])[None]
        types = self.token_types(ids)
        kw = {k: vision[k].clone() for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in vision}
        # feature detection: older transformers find visual runs from vision_start tokens instead of
        # mm_token_type_ids, and Qwen2-VL's get_rope_index there takes no second_per_grid_ts
        params = inspect.signature(self.rope_index).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        if "mm_token_type_ids" in params:
            kw["mm_token_type_ids"] = types
        kw = {k: x for k, x in kw.items() if k in params or takes_any}
        pos, _ = self.rope_index(ids, **kw)
        return pos[:, 0]


def normalize_vision(v: Mapping | None, g: int, prompt: Tensor, rope: MRopeIndex, what: str = "prompt"
                      ) -> dict[str, Tensor]:
    """Check the visual inputs of ``what`` ``g`` (a prompt or a whole sequence) against its placeholder
    tokens; returns the kept tensors (CPU)."""
    v = dict(v or {})
    unknown = sorted(set(v) - set(VISION_KEYS) - set(_IGNORED_KEYS))
    if unknown:
        raise ValueError(f"visual inputs of {what} {g}: unknown keys {unknown}; accepted: {list(VISION_KEYS)}")
    out = {k: torch.as_tensor(v[k]) for k in VISION_KEYS if v.get(k) is not None}
    if "mm_token_type_ids" in v and v["mm_token_type_ids"] is not None:
        given = torch.as_tensor(v["mm_token_type_ids"]).reshape(-1).cpu()
        if given.numel() != prompt.numel() or not torch.equal(given.int(), rope.token_types(prompt)):
            raise ValueError(f"{what} {g}: mm_token_type_ids do not match its placeholder tokens")
    for kind, pix, grid, tok in (("image", "pixel_values", "image_grid_thw", rope.image_token_id),
                                 ("video", "pixel_values_videos", "video_grid_thw", rope.video_token_id)):
        n_tok = int((prompt == tok).sum())
        if (pix in out) != (grid in out):
            raise ValueError(f"{what} {g}: {pix} and {grid} must be given together")
        if grid in out:
            gt = out[grid].long().cpu().reshape(-1, 3)
            out[grid] = gt
            pv = out[pix]
            if pv.ndim != 2 or pv.shape[0] != int(gt.prod(-1).sum()):
                raise ValueError(f"{what} {g}: {pix} has shape {tuple(pv.shape)} but {grid} {gt.tolist()} needs "
                                 f"{int(gt.prod(-1).sum())} patch rows")
        want = sum(rope.tokens_of(out.get(grid)))
        if n_tok == want and grid in out and kind == "image":   # a video's frames may be runs of their own
            _check_runs(prompt, tok, rope.tokens_of(out[grid]), grid, f"{what} {g}")
        if n_tok != want:
            raise ValueError(
                f"{what} {g} has {n_tok} {kind} placeholder tokens (id {tok}) but its {grid} gives {want} "
                f"({out.get(grid, torch.zeros(0, 3)).tolist()} with spatial_merge_size {rope.merge}): pass each "
                f"{what}'s own visual inputs, as the processor returned them"
            )
    if "second_per_grid_ts" in out:
        ts = out["second_per_grid_ts"].reshape(-1).cpu()
        n_vid = out["video_grid_thw"].shape[0] if "video_grid_thw" in out else 0
        if ts.numel() != n_vid:
            raise ValueError(f"{what} {g}: second_per_grid_ts has {ts.numel()} entries for {n_vid} videos")
        out["second_per_grid_ts"] = ts
    return out


def split_rows(prompts: list[Tensor], rope: MRopeIndex, tensors: dict, where: str = "from_padded"
               ) -> list[dict | None]:
    """Split batch-level visual tensors into each row's share, by the row's placeholder tokens (``where``: the
    caller, for messages)."""
    out: list[dict] = [{} for _ in prompts]
    for pix, grid, tok, extra in (("pixel_values", "image_grid_thw", rope.image_token_id, None),
                                  ("pixel_values_videos", "video_grid_thw", rope.video_token_id, "second_per_grid_ts")):
        pv, gt = tensors[pix], tensors[grid]
        if (pv is None) != (gt is None):
            raise ValueError(f"{where}: {pix} and {grid} must be given together")
        if gt is None:
            continue
        gt = torch.as_tensor(gt).long().cpu().reshape(-1, 3)
        ts = tensors[extra] if extra else None
        ts = torch.as_tensor(ts).reshape(-1).cpu() if ts is not None else None
        per_item = rope.tokens_of(gt)
        patches = gt.prod(-1).tolist()
        item, row_off = 0, 0
        for i, p in enumerate(prompts):
            need, got, first = int((p == tok).sum()), 0, item
            while got < need and item < len(per_item):
                got += per_item[item]
                item += 1
            if got != need:
                raise ValueError(f"{where}: row {i} has {need} placeholder tokens (id {tok}) but the {grid} "
                                 f"items left give {got}: {grid} must list every row's items, row after row")
            if item > first:
                if extra is None:   # images (a video's frames may be runs of their own)
                    _check_runs(p, tok, per_item[first:item], grid, f"{where}: row {i}")
                n_patch = sum(patches[first:item])
                out[i][grid] = gt[first:item]
                out[i][pix] = pv[row_off:row_off + n_patch]
                row_off += n_patch
                if ts is not None:
                    out[i][extra] = ts[first:item]
        if item != len(per_item) or row_off != pv.shape[0]:
            raise ValueError(f"{where}: {grid} lists {len(per_item)} items but the rows' placeholders use {item}; "
                             f"{pix} has {pv.shape[0]} rows, {row_off} used")
    return [d or None for d in out]


def _check_runs(seq: Tensor, tok: int, per_item: list[int], grid: str, what: str) -> None:
    """ValueError where an image's placeholders would span two runs of placeholder token ``tok`` in ``seq`` (1-D):
    the totals agree but the items' sizes do not match the runs (images given in another order than their
    placeholders, or a grid that is not the image's), which the model would read silently."""
    where = torch.nonzero(seq == tok)[:, 0]
    breaks = (torch.nonzero(where[1:] - where[:-1] > 1)[:, 0] + 1).tolist()      # placeholders before each run
    ends = set(torch.tensor(per_item).cumsum(0).tolist())
    bad = [b for b in breaks if b not in ends]
    if bad:
        runs = torch.tensor(breaks + [where.numel()]).diff(prepend=torch.tensor([0])).tolist()
        raise ValueError(f"{what}: its runs of placeholder tokens (id {tok}) have {runs} tokens but the {grid} items "
                         f"give {per_item} in order: an item would fill parts of two runs. Pass each row's items in "
                         f"the order of its placeholders, each item's grid as the processor returned it")


def vision_entries(vision, rows: Sequence[Tensor], rope: MRopeIndex, what: str, where: str) -> list:
    """``vision=`` as one entry (a mapping or None) per row of ``rows`` (1-D ids; ``what``: "prompt" or "sequence").

    A list or tuple gives one entry per row. One mapping (a processor's output for the whole batch, e.g. a
    ``BatchFeature``) is split by each row's placeholder tokens, item after item, row after row
    (:func:`split_rows`); ValueError naming the expected forms where it does not split exactly.
    """
    n = len(rows)
    if vision is None:
        return [None] * n
    if isinstance(vision, Mapping):
        unknown = sorted(set(vision) - set(VISION_KEYS) - set(_IGNORED_KEYS), key=str)
        if unknown:
            raise ValueError(f"{where}: vision= is one mapping with unknown keys {unknown}; accepted: "
                             f"{list(VISION_KEYS)} (or one entry, a mapping or None, per {what})")
        try:
            return split_rows(list(rows), rope, {k: vision.get(k) for k in VISION_KEYS}, where)
        except ValueError as e:
            raise ValueError(f"vision= is one mapping, read as the processor's output for all {n} {what}s in order, "
                             f"but it does not split into them: {e}. Give one entry per {what} instead: "
                             f"vision=[{{'pixel_values': ..., 'image_grid_thw': ...}} or None, ...]") from None
    if isinstance(vision, (str, bytes, Tensor)) or not hasattr(vision, "__len__"):
        raise ValueError(f"{where}: vision= takes one entry per {what} (a mapping of its visual inputs, or None), "
                         f"or the processor's one mapping for the whole batch; got a {type(vision).__name__}")
    vision = list(vision)
    if len(vision) != n:
        raise ValueError(f"{where}: {len(vision)} visual inputs for {n} {what}s: give one entry (or None) per {what}")
    bad = next((i for i, v in enumerate(vision) if v is not None and not isinstance(v, Mapping)), None)
    if bad is not None:
        raise ValueError(f"{where}: vision entry {bad} is a {type(vision[bad]).__name__}: each entry is a mapping "
                         f"of that {what}'s visual inputs ({', '.join(VISION_KEYS[:2])}, ...) or None")
    return vision


def same_vision(a: dict | None, b: dict | None) -> bool:
    a, b = a or {}, b or {}
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def visual_item_keys(seqs: Sequence[Tensor], kept: Sequence[Mapping[str, Tensor]], rope: MRopeIndex
                     ) -> tuple[list[list], list[dict[int, list[dict]]], list[tuple[str, dict]]]:
    """Trie keys of ``seqs`` (1-D ids) whose visual inputs ``kept`` (from :func:`normalize_vision`) fill their
    placeholders.

    Returns:
        keys: per sequence, one key per token: its id, or for the ``o``-th placeholder of a visual item
            ``(placeholder id, item id, o)``, the item id equal for equal pixels, grid and timing;
        items: per sequence, per placeholder id, its items in order (``{pixel key: [patches, D],
            grid key: [1, 3]}`` + ``second_per_grid_ts`` [1] for a timed video);
        distinct: per item id, ``(kind, item)`` with kind ``"image"`` or ``"video"``.
    """
    identity: dict[tuple, int] = {}
    distinct: list[tuple[str, dict]] = []
    items: list[dict[int, list[dict]]] = []
    keys = []
    for s, v in zip(seqs, kept):
        its: dict[int, list[dict]] = {}
        key = s.tolist()
        for kind, pix, grid, tok in (("image", "pixel_values", "image_grid_thw", rope.image_token_id),
                                     ("video", "pixel_values_videos", "video_grid_thw", rope.video_token_id)):
            if grid not in v:
                continue
            rows = [0] + v[grid].prod(-1).cumsum(0).tolist()
            where = torch.nonzero(s == tok)[:, 0].tolist()
            at = 0
            for j, n_tok in enumerate(rope.tokens_of(v[grid])):
                item = {pix: v[pix][rows[j]:rows[j + 1]], grid: v[grid][j:j + 1]}
                if kind == "video" and "second_per_grid_ts" in v:
                    item["second_per_grid_ts"] = v["second_per_grid_ts"][j:j + 1]
                ident = (kind,) + tuple((k, x.dtype, tuple(x.shape), _bytes(x)) for k, x in sorted(item.items()))
                iid = identity.setdefault(ident, len(identity))
                if iid == len(distinct):
                    distinct.append((kind, item))
                for o, t in enumerate(where[at:at + n_tok]):
                    key[t] = (tok, iid, o)
                at += n_tok
                its.setdefault(tok, []).append(item)
        items.append(its)
        keys.append(key)
    return keys, items, distinct


def _bytes(x: Tensor) -> bytes:
    """The raw bytes of ``x`` (on any device): an item's identity."""
    return x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
