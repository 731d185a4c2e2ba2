"""The model zoo: built-in small model configurations (random weights, never downloaded) and their cost model.

``tiny_config(arch)`` gives a few-layer config of each supported architecture for tests and
``flexgroup verify --arch``; ``tiny_config(arch, size="demo")`` the larger shape ``flexgroup demo``
times (Llama: hidden 256, MLP 1024, 4 layers, 8 heads, 4 KV heads). ``build_model`` turns either
into a model with seeded random weights.

Each architecture keeps the features that make it special, scaled down: Mistral's window on every
layer, Qwen2's windowed upper layers, Qwen3's ``layer_types``, Gemma 2's alternating
sliding/full layers with attention-logit softcapping and ``query_pre_attn_scalar``, Granite's
attention multiplier, SmolLM3's layers without RoPE. The tiny windows (8 tokens) are shorter than
the prompts the tests use, so the windowed masks are exercised; their weights are drawn 5x wider
than the default (``initializer_range=0.1``) so that attention scores reach the softcap and a
wrong mask changes the numbers visibly.
"""

from __future__ import annotations

from typing import Any

import torch

from ..reference.stock import stock_attention

__all__ = ["ARCHS", "HYBRID_ARCHS", "VL_ARCHS", "unavailable", "SIZES", "tiny_config", "build_model", "build_vl_model",
           "flops_per_token_and_pair", "ideal_speedup"]

# Shared shapes per size: (hidden, MLP, layers, heads, KV heads, head_dim, vocab).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=128,
                 initializer_range=0.1),  # larger weights: sharp attention, so a wrong mask shows
    "demo": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=32, vocab_size=2048),
}
_WINDOW = {"tiny": 8, "demo": 512}
_COMMON = dict(max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               attention_dropout=0.0, tie_word_embeddings=False, use_cache=False)


def _arch_overrides(size: str) -> dict[str, dict[str, Any]]:
    w = _WINDOW[size]
    L = SIZES[size]["num_hidden_layers"]
    hd = SIZES[size]["head_dim"]
    return {
        "llama": {},
        "mistral": dict(sliding_window=w),  # window on every layer
        # layers >= max_window_layers are windowed (HF computes layer_types from these)
        "qwen2": dict(use_sliding_window=True, sliding_window=w, max_window_layers=L // 2),
        # explicit layer_types (interleaved), the Qwen3 way; the window needs use_sliding_window
        "qwen3": dict(layer_types=["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(L)],
                      use_sliding_window=True, sliding_window=w),
        "gemma2": dict(sliding_window=w, query_pre_attn_scalar=hd * 2, attn_logit_softcapping=2.0,
                       final_logit_softcapping=10.0, hidden_activation="gelu_pytorch_tanh"),
        "phi3": dict(),
        "olmo2": dict(),
        "granite": dict(attention_multiplier=0.5 / hd ** 0.5, embedding_multiplier=2.0, residual_multiplier=0.5,
                        logits_scaling=2.0),
        "smollm3": dict(no_rope_layers=[1 if i % 2 == 0 else 0 for i in range(L)]),
        # hybrids (flexgroup/patches/hybrid.py): stateful mixers interleaved with full attention, first layer stateful
        **_hybrid_overrides(size),
    }


def _hybrid_overrides(size: str) -> dict[str, dict[str, Any]]:
    """Gated DeltaNet (conv kernel 4, chunk 64) and Mamba2 (conv 4, chunk 16 tiny / 64 demo) hybrids."""
    L, hd, d = SIZES[size]["num_hidden_layers"], SIZES[size]["head_dim"], SIZES[size]["hidden_size"]
    mixed = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
    gdn = dict(layer_types=mixed, linear_conv_kernel_dim=4, linear_key_head_dim=hd, linear_value_head_dim=hd,
               linear_num_key_heads=2, linear_num_value_heads=4)
    # Qwen3.5's rotary: partial, interleaved M-RoPE sections (text ids are expanded to equal rows)
    s = hd // 4
    mrope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_interleaved=True,
                 mrope_section=[s - 2 * (s // 3), s // 3, s // 3])
    moe = dict(num_experts=4, num_experts_per_tok=2, experts_implementation="eager")  # default MoE kernel: no f64
    chunk = 16 if size == "tiny" else 64
    mamba = dict(mamba_n_heads=4, mamba_d_head=2 * d // 4, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                 mamba_expand=2, mamba_chunk_size=chunk)
    return {
        "qwen3_5_text": dict(gdn, rope_parameters=mrope),
        "qwen3_next": dict(gdn, **moe, moe_intermediate_size=d // 2, shared_expert_intermediate_size=d // 2),
        "bamba": dict(mamba, attn_layer_indices=[i for i, t in enumerate(mixed) if t == "full_attention"]),
        "granitemoehybrid": dict(mamba, layer_types=mixed, num_local_experts=4, num_experts_per_tok=2,
                                 shared_intermediate_size=d, position_embedding_type="rope",
                                 experts_implementation="eager"),
        # NemotronH blocks are one of mamba / attention / mlp: each mixer gets an MLP block after it
        "nemotron_h": dict(layers_block_type=[t for m in mixed for t in (m, "mlp")], num_hidden_layers=2 * L,
                           mamba_num_heads=4, mamba_head_dim=2 * d // 4, n_groups=1, ssm_state_size=16,
                           conv_kernel=4, chunk_size=chunk, mlp_hidden_act="relu2"),
        # attention and a Mamba2 mixer side by side in every layer
        "falcon_h1": dict(mamba_n_heads=4, mamba_d_head=d // 4, mamba_d_ssm=d, mamba_d_state=16, mamba_n_groups=1,
                          mamba_d_conv=4, mamba_chunk_size=chunk),
        "olmo_hybrid": dict(layer_types=mixed, linear_conv_kernel_dim=4, linear_key_head_dim=hd,
                            linear_value_head_dim=hd, linear_num_key_heads=2, linear_num_value_heads=4),
    }


ARCHS: tuple[str, ...] = tuple(_arch_overrides("tiny"))
HYBRID_ARCHS: tuple[str, ...] = tuple(_hybrid_overrides("tiny"))


def unavailable(arch: str) -> str | None:
    """Why the installed transformers is below what flexgroup declares for ``arch``, or None.

    A hybrid is declared from its spec's ``forks_since`` (the oldest transformers on which flexgroup is
    tested to fork its mixers); any other architecture from transformers shipping its model type. On a
    transformers at or above that, ``arch`` is supported: a refusal there is a bug, and the tests that
    use this fail instead of skipping.
    """
    import transformers
    from packaging.version import Version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from flexgroup.patches import HYBRIDS

    installed = transformers.__version__
    spec = HYBRIDS.get(arch)
    if spec is not None and Version(installed) < Version(spec.forks_since):
        return f"flexgroup forks {arch} on transformers {spec.forks_since} and later; {installed} is installed"
    if spec is None and arch not in CONFIG_MAPPING:
        return f"transformers {installed} has no model type {arch!r}"
    return None


def tiny_config(arch: str, size: str = "tiny", **overrides):
    """A small transformers config of architecture ``arch`` (a ``config.model_type``).

    Args:
        arch: one of :data:`ARCHS`.
        size: ``"tiny"`` (hidden 64, 2 layers, vocab 128: tests, ``verify``) or ``"demo"``
            (hidden 256, MLP 1024, 4 layers, 8 heads, 4 KV heads, vocab 2048).
        overrides: any config field, applied last (e.g. ``num_hidden_layers=1``).

    Returns:
        a ``transformers.PretrainedConfig`` subclass instance.
    """
    from transformers import AutoConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}: built-in configs exist for {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: choose one of {', '.join(SIZES)}")
    kwargs = {**_COMMON, **SIZES[size], **_arch_overrides(size)[arch], **overrides}
    if arch == "phi3":  # phi3 has no head_dim field (hidden / heads) and a fused qkv projection
        kwargs.pop("head_dim", None)
        kwargs["hidden_size"] = kwargs["num_attention_heads"] * SIZES[size]["head_dim"]
    return AutoConfig.for_model(arch, **kwargs)


def build_model(arch_or_config, dtype: torch.dtype = torch.float32, seed: int = 0, size: str = "tiny",
                attn_implementation: str | None = None, **overrides) -> torch.nn.Module:
    """A causal LM with seeded random weights (``AutoModelForCausalLM.from_config``; no download).

    Args:
        arch_or_config: an architecture name (see :func:`tiny_config`) or a config object.
        dtype: parameter dtype.
        seed: weights are a function of the seed only (the global RNG state is restored after).
        attn_implementation: defaults to :func:`stock_attention` of the config.

    Returns:
        the model, in eval mode (no dropout) with gradients enabled on every parameter.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch_or_config, size, **overrides) if isinstance(arch_or_config, str) else arch_or_config
    impl = attn_implementation or stock_attention(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    return model.to(dtype).eval()  # cast after building: `dtype=` is not accepted by older transformers


# vision-language model types flexgroup.patch supports -> their transformers model class
VL_ARCHS = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
            "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration"}
VL_VOCAB, VL_IMAGE, VL_VIDEO, VL_START, VL_END = 128, 120, 121, 122, 123   # vocabulary; placeholders; vision start / end


def build_vl_model(arch: str, dtype: torch.dtype | None = None, seed: int = 0):
    """A tiny random vision-language model of ``arch`` (one of :data:`VL_ARCHS`): 2 decoder layers (Qwen3.5: one
    Gated DeltaNet, one full attention), a 1-2 block vision tower (patch 2, temporal patch 2, merge 2), vocabulary
    128 with the placeholders 120-123; sdpa, eval mode, seeded weights (the global RNG state is restored)."""
    import transformers

    if arch not in VL_ARCHS:
        raise ValueError(f"unknown vision-language architecture {arch!r}: choose one of {', '.join(VL_ARCHS)}")
    text = dict(vocab_size=VL_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, attention_dropout=0.0, bos_token_id=1,
                eos_token_id=2, rope_theta=10000.0, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    vision = dict(patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_heads=2)
    tower = dict(depth=2, hidden_size=16, intermediate_size=24, out_hidden_size=32)
    if arch == "qwen2_vl":
        vision.update(depth=1, embed_dim=16, hidden_size=32, mlp_ratio=2)
    elif arch == "qwen2_5_vl":
        vision.update(tower, window_size=8, fullatt_block_indexes=[1], tokens_per_second=2)
    else:   # Qwen3-VL and Qwen3.5: interleaved M-RoPE in rope_parameters (transformers 5), learned tower positions
        text = {k: v for k, v in text.items() if k not in ("rope_scaling", "rope_theta")}
        text.update(head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
        vision.update(tower, num_position_embeddings=16)
        if arch == "qwen3_vl":
            vision.update(deepstack_visual_indexes=[0, 1])
        else:
            text.update(layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                        linear_num_value_heads=4)
            text["rope_parameters"]["partial_rotary_factor"] = 1.0
    config = transformers.AutoConfig.for_model(arch, text_config=text, vision_config=vision, image_token_id=VL_IMAGE,
                                               video_token_id=VL_VIDEO, vision_start_token_id=VL_START,
                                               vision_end_token_id=VL_END)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, VL_ARCHS[arch])(config)
    return model.to(dtype or torch.float32).eval()


def flops_per_token_and_pair(config, include_lm_head: bool = False) -> tuple[float, float]:
    """Forward FLOPs (2 x MACs) of the decoder layers per token and per causal (query, key) pair.

    Per layer with hidden ``d``, ``Hq``/``Hkv`` heads of size ``Dh`` and gated MLP width ``f``:
    ``2*d*(Hq + 2*Hkv)*Dh + 2*Hq*Dh*d + 6*d*f`` per token and ``4*Hq*Dh`` per pair (QK^T and PV),
    summed over layers; windowed layers are counted as full causal layers. The LM head
    (``2*d*V`` per token) is left out unless ``include_lm_head``: trainers compute it on response
    positions only, so it is not work that sharing the prefix removes.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    d, f, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    dh = getattr(cfg, "head_dim", None) or d // hq
    per_token = n * (2 * d * (hq + 2 * hkv) * dh + 2 * hq * dh * d + 6 * d * f)
    if include_lm_head:
        per_token += 2 * d * cfg.vocab_size
    return float(per_token), float(n * 4 * hq * dh)


def ideal_speedup(config, layout, ends=None) -> float:
    """Exact-work ratio baseline / grouped of the decoder layers for ``layout`` (see ``Layout.cost``);
    ``ends``: the batch's sequences (``GroupedBatch.sequence_ends``), default the layout's root-to-leaf paths."""
    return layout.cost(ends).ideal_speedup(*flops_per_token_and_pair(config))
