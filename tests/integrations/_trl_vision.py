"""TRL GRPO on a tiny Qwen-VL checkpoint with images, without PIL or torchvision (neither is installed here).

- :func:`save_tiny_vl`: test_vl's random Qwen2-VL / Qwen2.5-VL / Qwen3-VL (2 decoder layers, tiny tower), or
  test_hybrids' Qwen3.5 (a Gated DeltaNet and a full-attention layer), and a :class:`PatchProcessor` saved
  to a directory, which TRL loads like any checkpoint.
- :class:`PatchProcessor`: a ``ProcessorMixin`` that does what a Qwen-VL processor does for TRL, on images
  that are already patches: an image is ``{"grid": [1, h, w], "pixels": [h * w * 24 floats]}``; the
  chat template writes ``<|vision_start|> <|image_pad|> <|vision_end|>`` for it and the processor expands
  ``<|image_pad|>`` to ``h * w / 4`` placeholders, returning ``pixel_values`` [patches, 24],
  ``image_grid_thw`` [images, 3] and ``mm_token_type_ids``. Both trainers see the same inputs.
- :func:`vl_dataset`: conversational prompts, one image each in the ``image`` column (two share their pixels).

Tokens: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, ``a``..``z`` 3..28, fillers, the vision tokens 120..123.
"""

from __future__ import annotations

import torch
from transformers import ProcessorMixin
from transformers.feature_extraction_utils import BatchFeature

from _trainers import LETTERS, word_tokenizer
from test_vl import IMG, PATCH_DIM, VE, VID, VS, make_vl

VISION_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]   # make_vl's ids


def vl_tokenizer():
    """:func:`word_tokenizer` with fillers up to id 119, then the vision tokens at make_vl's ids 120-123."""
    tok = word_tokenizer()
    tok.add_tokens([f"<unused{i}>" for i in range(len(tok), IMG)])
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.padding_side = "left"   # as TRL sets it for the processors it loads: mm_token_type_ids align with its prompts
    assert tok.convert_tokens_to_ids(VISION_TOKENS) == [IMG, VID, VS, VE]
    return tok


class PatchProcessor(ProcessorMixin):
    """Qwen-VL processor behaviour on pre-patched images (see the module docstring)."""

    attributes = ["tokenizer"]
    tokenizer_class = "PreTrainedTokenizerFast"

    def __init__(self, tokenizer=None, **kwargs):
        self.tokenizer = tokenizer
        self.chat_template = None
        self.image_processor = type("ImageProcessor", (), {"merge_size": 2})()

    def __call__(self, text=None, images=None, padding=False, return_tensors=None, **kwargs):
        texts = [text] if isinstance(text, str) else list(text)
        flat = [img for per in (images or []) if per for img in per]
        pix, grids, at = [], [], 0
        out_texts = []
        for t in texts:
            parts = t.split("<|image_pad|>")
            s = parts[0]
            for rest in parts[1:]:
                grid = torch.tensor(flat[at]["grid"]).long()
                pix.append(torch.tensor(flat[at]["pixels"], dtype=torch.float32).view(-1, PATCH_DIM))
                grids.append(grid)
                at += 1
                s += " ".join(["<|image_pad|>"] * (int(grid.prod()) // 4)) + rest
            out_texts.append(s)
        enc = self.tokenizer(out_texts, padding=padding, return_tensors=return_tensors)
        data = dict(enc)
        if grids:
            data["pixel_values"] = torch.cat(pix)
            data["image_grid_thw"] = torch.stack(grids)
        ids = data["input_ids"]
        data["mm_token_type_ids"] = ((torch.as_tensor(ids) == IMG).long() if return_tensors == "pt"
                                     else [[int(i == IMG) for i in row] for row in ids])
        return BatchFeature(data)

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=False, return_dict=False,
                            **kwargs):
        batched = isinstance(conversation[0], list)
        convs = conversation if batched else [conversation]
        texts, images = [], []
        for conv in convs:
            words, imgs = [], []
            for m in conv:
                content = m["content"]
                for c in ([{"type": "text", "text": content}] if isinstance(content, str) else content):
                    if c["type"] == "image":
                        words.append("<|vision_start|> <|image_pad|> <|vision_end|>")
                        imgs.append(c.get("image"))   # no payload: TRL 0.20 passes images separately
                    elif c["type"] == "text":
                        words.append(c["text"])
            texts.append(" ".join(words))
            images.append(imgs)
        if not tokenize:
            return texts if batched else texts[0]
        out = self(text=texts, images=images)
        return out if batched else {k: v[0] if k in ("input_ids", "attention_mask") else v for k, v in out.items()}

    def __getattr__(self, name):   # pad_token_id, eos_token_id, ...: the tokenizer's
        if name.startswith("__") or name == "tokenizer":
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)


def save_tiny_vl(path, kind: str, seed: int = 0) -> str:
    """test_vl's tiny Qwen-VL model (vocabulary 128, placeholders 120-123) and :func:`vl_tokenizer`, saved."""
    if kind == "qwen3_5":   # the hybrid: Gated DeltaNet + full attention decoder, Qwen3-VL-style tower
        import pytest
        import transformers

        if not hasattr(transformers, "Qwen3_5Config"):
            pytest.skip(f"qwen3_5 is not in transformers {transformers.__version__}")
        from test_hybrids import _qwen3_5_vl

        _qwen3_5_vl(torch.float32).save_pretrained(path)
    else:
        make_vl(kind, seed=seed).save_pretrained(path)
    vl_tokenizer().save_pretrained(path)
    return str(path)


def image(h: int, w: int, gen: torch.Generator) -> dict:
    return {"grid": [1, h, w], "pixels": torch.randn(h * w * PATCH_DIM, generator=gen).tolist()}


def vl_reward(completions, **kwargs):
    texts = [c[-1]["content"] for c in completions]   # conversational completions: lists of messages
    return [float(t.count("a") + t.count("e")) - 0.05 * len(t) for t in texts]


def vl_dataset(n: int, seed: int = 1, words: int = 6):
    """n conversational prompts of ``words + 2 i`` words, each with one image in TRL's ``image`` column (TRL puts
    it before the first user message); prompts 0 and 1 (when n >= 3) show the same pixels."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = {"prompt": [], "image": []}
    for i in range(n):
        rows["image"].append(rows["image"][0] if i == 1 and n >= 3 else image(4, 4 + 2 * (i % 2), g))
        text = " ".join(LETTERS[int(t)] for t in torch.randint(0, 26, (words + 2 * i,), generator=g))
        rows["prompt"].append([{"role": "user", "content": text}])
    return datasets.Dataset.from_dict(rows)
