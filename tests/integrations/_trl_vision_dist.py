"""Two-process TRL GRPO on a tiny Qwen2.5-VL with images (gloo, accelerate's MULTI_CPU: the Trainer wraps the policy
in DDP), for ``test_trl_vision.py``.

``python tests/integrations/_trl_vision_dist.py OUTDIR CASE [CASE ...]`` spawns 2 ranks as ``_trl_dist.py`` does
(``tests/_gloo.spawn_ranks``); each trains every CASE for 2 steps on the checkpoint in ``OUTDIR/model`` (same seed,
completions replayed, offset by rank) and saves ``OUTDIR/CASE.rank{r}.pt`` in ``_trl_dist.py``'s format.
Cases: ``vl_stock`` (TRL's GRPOTrainer), ``vl_flex`` (flexgroup), ``vl_budget_stock`` / ``vl_budget``
(longer prompts; flexgroup with ``flexgroup_budget=128``: every chunk streamed with its images).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "patches")]

from _gloo import spawn_ranks  # noqa: E402
from _trl_dist import Steps, _fix_generations, save_run  # noqa: E402

WORLD, G = 2, 3
# name -> (flexgroup keyword arguments or None for stock TRL, words per prompt)
CASES = {"vl_stock": (None, 6), "vl_flex": ({}, 6), "vl_budget_stock": (None, 60),
         "vl_budget": ({"flexgroup_budget": 128}, 60)}


def _train(name: str, rank: int, out: Path):
    import trl
    from _trl_vision import PatchProcessor, vl_dataset, vl_reward, vl_tokenizer

    from flexgroup.integrations.trl import FlexGroupGRPOTrainer

    kw, words = CASES[name]
    args = trl.GRPOConfig(
        output_dir=str(out / name), per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=8,
        steps_per_generation=1, gradient_accumulation_steps=1, num_iterations=2, beta=0.1, max_steps=2,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0, bf16=False,
        fp16=False, max_grad_norm=1.0, disable_dropout=True, temperature=0.7,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"})
    cls = type("T", (Steps, trl.GRPOTrainer if kw is None else FlexGroupGRPOTrainer), {})
    extra = {} if kw is None else dict(kw, flexgroup_backend="sdpa")
    trainer = cls(model=str(out / "model"), reward_funcs=vl_reward, args=args, processing_class=PatchProcessor(
        vl_tokenizer()), train_dataset=vl_dataset(WORLD * 2, words=words), **extra)
    _fix_generations(trainer, rank)
    trainer.train()
    return trainer


def _worker(rank: int, world: int, outdir: str, cases: list[str]) -> None:
    os.environ.update(TOKENIZERS_PARALLELISM="false")
    for name in cases:
        save_run(lambda: _train(name, rank, Path(outdir)), Path(outdir) / f"{name}.rank{rank}.pt")


if __name__ == "__main__":
    spawn_ranks(_worker, WORLD, (sys.argv[1], sys.argv[2:]), collective_timeout=120, deadline=300)
