"""TRL GRPO on a Qwen2.5-VL with images: tokens through the decoder, patches through the vision tower, and CPU step
time, stock TRL versus flexgroup (issue 41, item 3; docs/trl.md).

``python benchmarks/trl_vision.py [--rounds 5] [--out benchmarks/results/trl-vision-1t.json]`` (1 torch thread,
no GPU; a few minutes on one core). A GRPO-shaped batch: 8 prompts x G = 8 completions, each prompt one image
(``image_grid_thw`` (1, 16, 16): 256 patches, 64 placeholder tokens) and 40-90 text tokens, completions of 16-48
tokens, in TRL's layout (left-padded prompts, right-padded completions, each row its own copy of its prompt's
pixels, ``num_images``, ``mm_token_type_ids``). One step = what ``GRPOTrainer`` runs per optimizer step with
``beta > 0`` and one iteration: the reference model's log-probs (no grad), then the policy's log-probs and
entropies with gradients and the backward of ``sum(adv * logps)``; ``per_device_train_batch_size`` 64 rows,
TRL's ``_get_per_token_logps_and_entropies`` (stock) or flexgroup's (``patch_trainer``, backend sdpa).

Counted by forward hooks on the models themselves (independent of flexgroup's own counters, which are
checked against them): decoder tokens (``hidden_states`` into the first decoder layer) and patch rows into
the vision tower, per step. Timed: interleaved rounds (stock, flexgroup, alternating which goes first), the
median per method. "Ideal": the stock step's tower share (the tower alone over every row's copy, forward and
backward, timed in the same rounds) scaled by the patch ratio, the rest by the decoder-token ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import warnings
from pathlib import Path

import torch

from flexgroup.bench.measure import time_interleaved, write_json

warnings.filterwarnings("ignore")
G, PROMPTS, GRID = 8, 8, (1, 16, 16)
V, IMG, VID, VS, VE = 512, 500, 501, 502, 503
PATCH = 3 * 2 * 2 * 2   # channels x temporal patch x patch x patch (patch size 2)


def model_dir(tmp: Path) -> str:
    import transformers as tf
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    text = dict(vocab_size=V, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})
    cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=dict(
        patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_heads=4, depth=4, hidden_size=64,
        intermediate_size=192, out_hidden_size=128, window_size=8, fullatt_block_indexes=[3], tokens_per_second=2),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tf.Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(tmp)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2},
                                                                              unk_token="<unk>")),
                                  pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(tmp)
    return str(tmp)


def grpo_batch(seed: int = 0):
    """TRL's arguments: ids [64, Lp + k], attention mask, k, the visual keyword arguments, advantages [64, 1]."""
    g = torch.Generator().manual_seed(seed)
    n_img = GRID[0] * GRID[1] * GRID[2] // 4
    prompts, pixels = [], []
    for _ in range(PROMPTS):
        a, b = (int(torch.randint(20, 46, (1,), generator=g)) for _ in range(2))
        prompts.append(torch.cat([torch.randint(3, 400, (a,), generator=g), torch.tensor([VS] + [IMG] * n_img + [VE]),
                                  torch.randint(3, 400, (b,), generator=g)]))
        pixels.append(torch.randn(GRID[0] * GRID[1] * GRID[2], PATCH, generator=g))
    lens = torch.randint(16, 49, (PROMPTS * G,), generator=g)
    Lp, k = max(len(p) for p in prompts), int(lens.max())
    n = PROMPTS * G
    ids, am = torch.zeros(n, Lp + k, dtype=torch.long), torch.zeros(n, Lp + k, dtype=torch.long)
    for i in range(n):
        p = prompts[i // G]
        ids[i, Lp - len(p):Lp], am[i, Lp - len(p):Lp] = p, 1
        ids[i, Lp:Lp + lens[i]], am[i, Lp:Lp + lens[i]] = torch.randint(3, 400, (int(lens[i]),), generator=g), 1
    kw = dict(pixel_values=torch.cat([pixels[i // G] for i in range(n)]),
              image_grid_thw=torch.tensor([GRID] * n), num_images=[1] * n,
              mm_token_type_ids=((ids == IMG) & am.bool()).long())
    return ids, am, k, kw, torch.randn(n, 1, generator=g)


def trainer_for(path: str, tmp: Path):
    import datasets
    import trl

    args = trl.GRPOConfig(output_dir=str(tmp / "out"), per_device_train_batch_size=PROMPTS * G, num_generations=G,
                          beta=0.1, report_to="none", use_cpu=True, bf16=False, fp16=False, max_completion_length=48,
                          model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"})
    from transformers import AutoTokenizer

    return trl.GRPOTrainer(model=path, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                           train_dataset=datasets.Dataset.from_dict({"prompt": ["a"] * 8}),
                           processing_class=AutoTokenizer.from_pretrained(path))


def counters(trainer) -> dict[str, int]:
    c = {"decoder_tokens": 0, "tower_patches": 0}
    for m in (trainer.model, trainer.ref_model):
        base = m.model
        base.language_model.layers[0].register_forward_pre_hook(   # hidden_states [B, L, H]
            lambda mod, args, kwargs: c.__setitem__("decoder_tokens", c["decoder_tokens"] + kwargs.get(
                "hidden_states", args[0] if args else None)[..., 0].numel()), with_kwargs=True)
        base.visual.register_forward_pre_hook(
            lambda mod, args, kwargs: c.__setitem__("tower_patches", c["tower_patches"] + kwargs.get(
                "hidden_states", args[0] if args else None).shape[0]), with_kwargs=True)
    return c


def step(trainer, batch) -> None:
    ids, am, k, kw, adv = batch
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, am, k, batch_size=ids.shape[0], **kw)
    lp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, k, batch_size=ids.shape[0],
                                                    compute_entropy=True, **kw)[0]
    (lp * adv * am[:, -k:]).sum().backward()
    trainer.model.zero_grad(set_to_none=True)


def tower(trainer, batch) -> None:
    """The stock step's vision-tower work alone: the tower over every row's copy, forward and backward (the
    reference pass's tower forward is left out: this slightly under-counts the tower's share)."""
    kw = batch[3]
    trainer.model.model.visual(kw["pixel_values"], grid_thw=kw["image_grid_thw"]).pooler_output.sum().backward()
    trainer.model.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "trl-vision-1t.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    from flexgroup.integrations.trl import patch_trainer

    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(Path(tmp) / "model")
        stock, flex = trainer_for(path, Path(tmp)), trainer_for(path, Path(tmp))
        patch_trainer(flex, backend="sdpa")
        batch = grpo_batch()
        counts = {}
        for name, t in (("stock", stock), ("flexgroup", flex)):
            c = counters(t)
            step(t, batch)   # warm-up, counted
            counts[name] = dict(c)
        s = {role: dict(v) for role, v in flex.flexgroup_stats.items()}   # the adapter's own counts of that step
        times = time_interleaved({"stock": lambda: step(stock, batch), "flexgroup": lambda: step(flex, batch),
                                  "stock_tower": lambda: tower(stock, batch)}, a.rounds, warmup=0, alternate=True)
    assert counts["flexgroup"]["decoder_tokens"] == s["policy"]["grouped_tokens"] + s["ref"]["grouped_tokens"]
    assert counts["flexgroup"]["tower_patches"] == s["policy"]["vision_patches"] + s["ref"]["vision_patches"]
    assert counts["stock"]["tower_patches"] == s["policy"]["baseline_patches"] + s["ref"]["baseline_patches"]
    med = {k: statistics.median(v) for k, v in times.items()}
    ids, am = batch[0], batch[1]
    res = {
        "batch": f"{PROMPTS} prompts x G={G}, one image {list(GRID)} each ({GRID[1] * GRID[2]} patches, "
                 f"{GRID[1] * GRID[2] // 4} tokens); rows {tuple(ids.shape)}, {int(am.sum())} real tokens",
        "step": "reference log-probs (no grad) + policy log-probs and entropies with backward",
        "per_step": {name: {k: v for k, v in c.items()} for name, c in counts.items()},
        "decoder_token_ratio": counts["flexgroup"]["decoder_tokens"] / counts["stock"]["decoder_tokens"],
        "tower_patch_ratio": counts["flexgroup"]["tower_patches"] / counts["stock"]["tower_patches"],
        "step_seconds_median": med, "step_seconds": times,
        "time_ratio": med["flexgroup"] / med["stock"], "rounds": a.rounds, "threads": 1,
        "torch": torch.__version__,
    }
    # each part of the stock step scaled by its own ratio: the tower by the patch ratio, the rest by the
    # decoder-token ratio
    share = min(1.0, med["stock_tower"] / med["stock"])
    res["stock_tower_share"] = share
    res["ideal_ratio"] = share * res["tower_patch_ratio"] + (1 - share) * res["decoder_token_ratio"]
    write_json(res, a.out)
    print(json.dumps({k: v for k, v in res.items() if k != "step_seconds"}, indent=1))


if __name__ == "__main__":
    main()
