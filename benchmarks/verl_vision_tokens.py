"""Decoder tokens and vision-tower patches per verl actor pass on a vision-language GRPO batch, stock vs flexgroup.

``python benchmarks/verl_vision_tokens.py`` (needs verl 0.9; no GPU; a few minutes on one core). The sibling of
``benchmarks/verl_tokens.py`` for Qwen-VL batches (docs/verl.md). The batch is what verl's agent loop hands
the actor for Qwen2.5-VL: 8 prompts x G=8 responses, one image per prompt (a 28 x 28 patch grid: 784 patch
rows, 196 placeholder tokens after the 2 x 2 merge), prompt text 30-120 tokens, responses 50-400 tokens;
``position_ids`` ``[N, 4, L]`` from the model's own ``get_rope_index``; ``multi_modal_inputs`` with every
sample's own copy of its prompt's image. It runs through flexgroup's engine's own ``forward_backward_batch``
(forward-only, as the old-log-prob pass; the engine plans the whole mini-batch under verl's token budget) on
a tiny random Qwen2.5-VL (counts do not depend on the weights or the width). Counted by forward hooks on the
model: token ids entering the decoder's embedding and patch rows entering the vision tower; the stock columns
are ``engine.flexgroup_stats``' counts of what verl's own micro-batches (``prepare_micro_batches``) feed the
model (``real_tokens``, ``vision_patches``: every sample's copy). Ideal: every prompt and image once per step.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
PROMPTS, G, GRID = 8, 8, (1, 28, 28)
sys.path[:0] = [str(ROOT / "tests" / "patches"), str(ROOT / "tests" / "integrations")]  # tiny models, verl batches


def model():
    from test_vl import make_vl

    m = make_vl("qwen2_5_vl")
    m.config.text_config.max_position_embeddings = 8192  # the tiny config says 512; default RoPE has no limit
    return m


def rows(m, g: torch.Generator):
    """(prompt ids, response ids, vision) per sample; a prompt's G samples carry copies of one image."""
    from test_vl import Prompt

    out = []
    for _ in range(PROMPTS):
        p = Prompt("qwen2_5_vl", g).text(int(torch.randint(20, 80, (1,), generator=g)))
        p.image(*GRID[1:]).text(int(torch.randint(10, 40, (1,), generator=g)))
        ids, vision = p.build()
        for _ in range(G):
            r = torch.randint(3, 100, (int(torch.randint(50, 401, (1,), generator=g)),), generator=g)
            out.append((ids, r, {k: v.clone() for k, v in vision.items()}))
    return out


def verl_batch(m, samples, **meta):
    """verl's actor batch (``left_right_2_no_padding``) with ``position_ids`` [N, 4, L] and ``multi_modal_inputs``:
    the vision-language test harness's, padded to this batch's widths."""
    from _verl_vision_harness import verl_batch as harness_batch

    widths = max(len(p) for p, _, _ in samples), max(len(r) for _, r, _ in samples)
    return harness_batch(samples, m, widths=widths, temperature=1.0, calculate_entropy=False, use_remove_padding=True,
                         **meta)


def make_engine(m):
    """flexgroup's verl engine around the tiny model (verl's FSDP build skipped: one process, forward-only)."""
    import flexgroup
    from flexgroup.integrations.verl import FlexGroupFSDPEngine, TokenStats

    engine = FlexGroupFSDPEngine.__new__(FlexGroupFSDPEngine)
    engine.module, engine.flexgroup_stats, engine._flexgroup_warned = m, TokenStats(), set()
    engine._flexgroup_planning, engine._autocast_dtype, engine._flexgroup_patch_error = False, torch.float32, None
    engine.ulysses_sequence_parallel_size, engine.use_ulysses_sp, engine.ulysses_device_mesh = 1, False, None
    engine.engine_config, engine.scaler = SimpleNamespace(strategy="fsdp2"), None
    engine.get_data_parallel_size = lambda: 1
    flexgroup.patch(m, backend="sdpa")
    return engine


def count(m, samples, **meta) -> dict[str, int]:
    from verl.workers.engine.utils import prepare_micro_batches

    engine = make_engine(m)
    seen = {"tokens": 0, "patches": 0}
    hooks = [m.get_input_embeddings().register_forward_pre_hook(
                 lambda mod, a: seen.__setitem__("tokens", seen["tokens"] + a[0].numel())),
             m.model.visual.register_forward_pre_hook(
                 lambda mod, a: seen.__setitem__("patches", seen["patches"] + a[0].shape[0]))]
    data = verl_batch(m, samples, **meta)
    n_micro = len(prepare_micro_batches(verl_batch(m, samples, **meta))[0])
    with torch.no_grad():
        engine.forward_backward_batch(data, None, forward_only=True)
    for h in hooks:
        h.remove()
    st = engine.flexgroup_stats
    assert st.fallback_micro_batches == 0 and seen["tokens"] == st.grouped_tokens
    assert seen["patches"] == st.grouped_vision_patches
    return {"micro_batches": n_micro, "forwards": st.forwards, "stock_tokens": st.real_tokens,
            "tokens": st.grouped_tokens, "stock_patches": st.vision_patches, "patches": st.grouped_vision_patches}


def main() -> None:
    from _verl_harness import register_cpu_platform  # verl has no CPU platform of its own

    torch.set_num_threads(1)
    register_cpu_platform()
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    m = model()
    samples = rows(m, torch.Generator().manual_seed(0))
    # ideal: each prompt (text + image placeholders) and each response once; each image once
    ideal_tokens = sum(len(samples[k * G][0]) for k in range(PROMPTS)) + sum(len(r) for _, r, _ in samples)
    ideal_patches = PROMPTS * GRID[0] * GRID[1] * GRID[2]
    splits = {"micro 8 (whole groups)": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 8},
              "micro 16 (two groups)": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 16},
              "micro 4 (half groups)": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4},
              "dynamic bsz, 8192 tokens": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 8192},
              "dynamic bsz, 4096 tokens": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 4096}}
    print(f"| batch | micro-batching | micro-batches | flexgroup forwards | decoder tokens, stock (remove-padding) "
          f"| decoder tokens, flexgroup | ratio (ideal {ideal_tokens / sum(len(p) + len(r) for p, r, _ in samples):.3f})"
          f" | tower patches, stock | tower patches, flexgroup | ratio (ideal {1 / G:.3f}) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, meta in splits.items():
        c = count(m, samples, **meta)
        print(f"| VL GRPO {PROMPTS}x{G}, one image each | {name} | {c['micro_batches']} | {c['forwards']} | "
              f"{c['stock_tokens']:,} | {c['tokens']:,} | {c['tokens'] / c['stock_tokens']:.3f} | "
              f"{c['stock_patches']:,} | {c['patches']:,} | {c['patches'] / c['stock_patches']:.3f} |")
    print(f"\nideal: {ideal_tokens:,} decoder tokens, {ideal_patches:,} tower patches")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
