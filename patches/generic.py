"""The self-checked generic path for decoders outside the registry.

A decoder qualifies when its attention goes through transformers' AttentionInterface and its RoPE
(or position embedding) takes ``position_ids``. Nothing about it is assumed: windows and softcaps
are read from the kwargs each attention module passes, and before the real model is touched a
deep copy of it (float32, eval mode) runs a tiny grouped forward through flexgroup (lengthened to
cover a config window below 64 tokens) and each ``[prompt; response]`` alone through its stock
attention; the logits must agree. Any failure --
an exception on the way, or a numeric mismatch -- makes ``patch`` raise, naming the model type and
the reason.
"""

from __future__ import annotations

import copy

import torch

from ._common import ArchSpec, find_language_model

__all__ = ["spec_for", "language_model", "self_check", "SELF_CHECK_PROMPT", "SELF_CHECK_RESPONSES"]

SELF_CHECK_PROMPT = 7
SELF_CHECK_RESPONSES = (4, 2, 5)
_TOL = 1e-4  # float32, relative to the logits' scale


class NotSupported(ValueError):
    """The model cannot be patched exactly (the message names the model type and the reason)."""


def spec_for(model_type: str) -> ArchSpec:
    return ArchSpec(model_type=model_type, language_model="model", facts=None, from_kwargs=True,
                    positions="generic: position_ids passed through; verified by the self-check")


def language_model(base: torch.nn.Module, model_type: str) -> torch.nn.Module:
    try:
        return find_language_model(base, "model")
    except TypeError as e:
        raise NotSupported(f"flexgroup.patch: model type {model_type!r} is not in the registry and has no "
                           f"decoder layers flexgroup can find ({e})") from None


def self_check(base: torch.nn.Module, lm: torch.nn.Module, apply_fn) -> None:
    """Grouped-vs-one-by-one forward on a float32 deep copy of ``base``; raises NotSupported on failure."""
    from flexgroup.batch import GroupedBatch

    model_type = base.config.model_type

    def fail(reason: str):
        raise NotSupported(f"flexgroup.patch: model type {model_type!r} is not in the registry and failed the "
                           f"generic self-check: {reason}. flexgroup would not be exact for it")

    config = base.config
    if getattr(config, "is_encoder_decoder", False):
        fail("encoder-decoder models are not supported")
    if getattr(config, "attention_chunk_size", None):
        fail(f"chunked attention (attention_chunk_size={config.attention_chunk_size}) is not read from the "
             "attention kwargs")
    unknown = sorted(set(getattr(config, "layer_types", None) or []) - {"full_attention", "sliding_attention"})
    if unknown:
        fail(f"layer types {unknown} are not supported")
    # exercise a small window inside the check itself; a large one is taken from the kwargs as passed
    w = getattr(config, "sliding_window", None)
    w = w if isinstance(w, int) and not isinstance(w, bool) and 0 < w < 64 else 0
    p_len = max(SELF_CHECK_PROMPT, w + 2)
    r_lens = (max(SELF_CHECK_RESPONSES[0], w + 3),) + SELF_CHECK_RESPONSES[1:]
    twin = copy.deepcopy(base).float().eval()  # deep copy: its config too
    twin_lm = find_language_model(twin, "model")
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 2:
        fail("config.vocab_size is missing")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (p_len,), generator=g)
    responses = [torch.randint(0, vocab, (n,), generator=g) for n in r_lens]
    device = next(twin.parameters()).device
    with torch.no_grad():
        try:
            ref = [twin(input_ids=torch.cat([prompt, r])[None].to(device), use_cache=False).logits[0]
                   for r in responses]
        except Exception as e:  # noqa: BLE001 -- reported as the reason
            fail(f"the stock model does not run on a plain input ({type(e).__name__}: {e})")
        try:
            apply_fn(twin, twin_lm, spec_for(model_type), "sdpa")
            batch = GroupedBatch.from_groups([prompt], [responses])
            out = twin(**batch.model_inputs(device)).logits[0]
        except Exception as e:  # noqa: BLE001
            fail(f"the grouped forward raised {type(e).__name__}: {e}")
    if out.shape[-1] != ref[0].shape[-1]:
        fail("the grouped forward returned logits of another vocabulary size")
    for i, (path, r) in enumerate(zip(batch.layout.paths(), ref)):
        err = (out[path] - r).abs().max().item()
        scale = 1.0 + r.abs().max().item()
        if not err <= _TOL * scale:
            fail(f"response {i}: grouped logits differ from running [prompt; response] alone by {err:.3g} "
                 "(its attention or positions do not follow position_ids / the attention interface)")
    del twin
