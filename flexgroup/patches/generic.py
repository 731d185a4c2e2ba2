"""The self-checked generic path for decoders outside the registry.

A decoder qualifies when its attention goes through transformers' AttentionInterface and its RoPE
(or position embedding) takes ``position_ids``. Nothing about it is assumed: windows and softcaps
are read from the kwargs each attention module passes, and before the real model is touched a
deep copy of it (float32, eval mode, its class's own ``forward`` even where an instance-level
closure replaced it: :func:`flexgroup.reference.oracle.own_copy`) runs a small grouped forward through flexgroup and each
root-to-leaf sequence alone through its stock attention; the logits (a classifier's decoder hidden
states) must agree. Any failure -- an exception on the way, or a numeric mismatch -- makes
``patch`` raise, naming the model type and the reason.

The check row is built to expose what a mask cannot fix: two groups and a 3-level tree in one row;
a first prompt that crosses a 64-token chunk boundary (linear-attention kernels chunk by 64) and is
lengthened past a config window or original RoPE length up to 512 tokens; responses of 1 and 2
tokens (shorter than a causal-conv window) and a 1-token middle segment. Stateful token mixers
(Mamba, DeltaNet, short convs, RWKV, ...: anything :func:`flexgroup.patches.hybrid.stateful_modules`
finds) are refused before the check, naming the layer class: the registered hybrids in
``flexgroup.patches.HYBRIDS`` are the ones whose state flexgroup forks.
"""

from __future__ import annotations

import torch

from flexgroup.layout import Layout
from flexgroup.reference.oracle import own_copy

from ._common import ArchSpec, find_language_model
from .hybrid import stateful_modules

__all__ = ["spec_for", "language_model", "self_check", "check_layout"]

_TOL = 1e-4  # float32, relative to the logits' scale
_CROSS = 512  # thresholds (windows, original RoPE lengths) up to this many tokens are crossed by the check row


def _thresholds(config) -> list[int]:
    """Config lengths at which a model's behaviour may change: sliding window, original RoPE length."""
    found = [getattr(config, "sliding_window", None)]
    for rope in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(rope, dict):
            found.append(rope.get("original_max_position_embeddings"))
    return [int(t) for t in found if isinstance(t, int) and not isinstance(t, bool) and 0 < t <= _CROSS]


def check_layout(config) -> Layout:
    """The self-check row: ``[P; 1, 2, 5 tokens]`` (P >= 70, past any threshold <= 512, within
    ``max_position_embeddings``), ``[3; 2, 1]``, and a tree 4 -> 1 -> (2, 3) with a 1-token middle."""
    p_len = max([70] + [t + 2 for t in _thresholds(config)])
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and p_len + 6 > limit:
        p_len = max(limit - 6, 4)
    return Layout.pack([Layout.group(p_len, [1, 2, 5]), Layout.group(3, [2, 1]),
                        Layout.tree(parents=[-1, 0, 1, 1], lengths=[4, 1, 2, 3])])


class NotSupported(ValueError):
    """The model cannot be patched exactly (the message names the model type and the reason)."""


def spec_for(model_type: str) -> ArchSpec:
    return ArchSpec(model_type=model_type, language_model="model", facts=None, from_kwargs=True)


def language_model(base: torch.nn.Module, model_type: str, supported: tuple[str, ...] = ()) -> torch.nn.Module:
    try:
        return find_language_model(base, "model")
    except TypeError:
        raise NotSupported(
            f"flexgroup.patch: model type {model_type!r} ({type(base).__name__}) is not supported: flexgroup "
            "shares prefixes in rotary (RoPE) decoders whose layers sit at .layers or .model.layers and call "
            f"attention through transformers' attention interface, and found no such decoder layers in it "
            f"(absolute position embeddings, as in GPT-2, cannot take virtual positions). Supported: "
            f"{', '.join(supported) or 'the registry of flexgroup.patches'}, and other Llama-style decoders "
            "after a built-in self-check (e.g. olmo2, phi3, granite, mixtral, qwen3_moe)") from None


def self_check(base: torch.nn.Module, lm: torch.nn.Module, apply_fn) -> None:
    """Grouped-vs-one-by-one forward on a float32 deep copy of ``base``; raises NotSupported on failure."""
    from flexgroup.data.batch import GroupedBatch
    from flexgroup.reference.model_checks import check_materialized

    model_type = base.config.model_type
    check_materialized(base, f"flexgroup.patch (the generic self-check of {model_type!r} runs the model; patch "
                             "after loading)")

    def fail(reason: str):
        raise NotSupported(f"flexgroup.patch: model type {model_type!r} is not in the registry and failed the "
                           f"generic self-check: {reason}. flexgroup would not be exact for it")

    config = base.config
    if getattr(config, "is_encoder_decoder", False):
        fail("encoder-decoder models are not supported")
    if getattr(config, "attention_chunk_size", None):
        fail(f"chunked attention (attention_chunk_size={config.attention_chunk_size}) is not read from the "
             "attention kwargs")
    stateful = stateful_modules(lm)
    if stateful:
        names = sorted({name for _, name, _ in stateful})
        fail(f"layer {stateful[0][0]} holds {', '.join(names)}: a stateful token mixer (it carries state along "
             "the sequence), which a packed row would leak from one response into the next; flexgroup forks state "
             "only for the registered hybrids (flexgroup.patches.HYBRIDS)")
    known = {"full_attention", "sliding_attention"}
    if not getattr(config, "attention_chunk_size", None):
        known.add("chunked_attention")  # without a chunk size such a layer attends like a full one
    unknown = sorted(set(getattr(config, "layer_types", None) or []) - known)
    if unknown:
        fail(f"layer types {unknown} are not supported")
    layout = check_layout(config)
    # a deep copy (its config too) that runs its own class forward, also where the caller's forward was
    # replaced by a closure over the original model (TRL's fused LM head)
    twin = own_copy(base)[0].float().eval()  # FSDP2-sharded: rebuilt unsharded (a collective)
    twin_lm = find_language_model(twin, "model")
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 2:
        fail("config.vocab_size is missing")
    ids = torch.randint(0, vocab, (layout.num_tokens,), generator=torch.Generator().manual_seed(0))
    batch = GroupedBatch.from_layout(layout, ids)
    device = next(twin.parameters()).device
    # a *ForSequenceClassification model pools one row per sequence: compare its decoder's hidden states
    classifier = isinstance(getattr(twin, "score", None), torch.nn.Module)
    run, field = (twin_lm, "last_hidden_state") if classifier else (twin, "logits")
    with torch.no_grad():
        try:
            ref = [run(input_ids=ids[path][None].to(device), use_cache=False)[field][0] for path in batch.paths]
        except Exception as e:  # noqa: BLE001 -- reported as the reason
            fail(f"the stock model does not run on a plain input ({type(e).__name__}: {e})")
        try:
            apply_fn(twin, twin_lm, spec_for(model_type), "sdpa")
            out = run(**batch.model_inputs(device))[field][0]
        except Exception as e:  # noqa: BLE001
            fail(f"the grouped forward raised {type(e).__name__}: {e}")
    if out.shape[-1] != ref[0].shape[-1]:
        fail("the grouped forward returned logits of another vocabulary size")
    for i, (path, r) in enumerate(zip(batch.paths, ref)):
        err = (out[path] - r).abs().max().item()
        scale = 1.0 + r.abs().max().item()
        if not err <= _TOL * scale:
            fail(f"response {i}: grouped logits differ from running its sequence alone by {err:.3g} "
                 "(its attention or positions do not follow position_ids / the attention interface)")
    del twin
