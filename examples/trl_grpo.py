"""GRPO with TRL, each prompt encoded once per group: ``FlexGroupGRPOTrainer``.

Runs offline out of the box (a tiny random Llama and a word-level tokenizer built here, CPU, a few
seconds per step):

    pip install -e ".[trl]"      # from the flexgroup checkout
    python examples/trl_grpo.py --steps 2

With a real model (a local directory with its tokenizer, or a hub id already in the local Hugging Face
cache: nothing is downloaded, so fetch it first; a GPU is where the speed is):

    hf download Qwen/Qwen2.5-0.5B-Instruct
    python examples/trl_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 10

The only difference from a plain TRL script is the trainer class (``FlexGroupGRPOTrainer``
instead of ``GRPOTrainer``), or ``patch_trainer(trainer)`` on a trainer you already built.
Keep ``per_device_train_batch_size`` a multiple of ``num_generations`` so that every micro-batch
holds whole groups.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch


def tiny_model_dir() -> str:
    """A tiny random Llama and a word-level tokenizer (letters a-z), saved once into flexgroup's cache folder
    and reused (:func:`flexgroup.models.checkpoints.save_tiny_checkpoint`); no downloads."""
    from flexgroup.models.checkpoints import save_tiny_checkpoint

    return save_tiny_checkpoint()


def main(argv=None) -> int:
    """Exit 0 on success, 1 when the trained policy's check fails, 2 with a one-line error for a bad ``--model``
    or a missing TRL (as the ``flexgroup`` CLI)."""
    from flexgroup.cli import run_script

    return run_script("trl_grpo.py", run, argv)


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="local checkpoint directory with its tokenizer, or a hub id "
                    "already in the local cache; nothing is downloaded (default: a tiny random model built here)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--backend", default="auto", help="flexgroup attention backend: auto, sdpa, flex")
    ap.add_argument("--output-dir", default=None, help="TRL's output directory (default: a temporary one, removed "
                    "at the end)")
    args = ap.parse_args(argv)

    from datasets import Dataset

    from flexgroup.cli import model_directory

    # a local directory or a hub id already cached (offline), with its tokenizer: else one line with the fix
    model = model_directory(args.model, tokenizer=True) if args.model else tiny_model_dir()
    g = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    # long shared prompts, short completions: the regime where sharing the prompt pays
    prompts = [" ".join(letters[int(i)] for i in torch.randint(0, 26, (64,), generator=g)) for _ in range(16)]
    dataset = Dataset.from_dict({"prompt": prompts})

    def reward_vowels(completions, **kwargs):
        return [sum(c.count(v) for v in "aeiou") / (1 + len(c.split())) for c in completions]

    with tempfile.TemporaryDirectory(prefix="flexgroup_grpo_") as scratch:  # removed at the end
        return _train(args, model, dataset, reward_vowels, args.output_dir or scratch)


def _train(args, model: str, dataset, reward, output_dir: str) -> int:
    from trl import GRPOConfig

    from flexgroup.integrations.trl import FlexGroupGRPOTrainer

    config = GRPOConfig(
        output_dir=output_dir,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations * args.prompts_per_step,  # whole groups per micro-batch
        max_completion_length=16,
        max_steps=args.steps,
        learning_rate=1e-4,
        beta=0.04,                 # uses a reference model: its log-probs go through the grouped forward too
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        # bf16 weights with bf16 autocast on a GPU; plain float32 on CPU
        bf16=torch.cuda.is_available(),
        model_init_kwargs={"dtype": torch.bfloat16 if torch.cuda.is_available() else torch.float32,
                           "attn_implementation": "sdpa"},
    )
    trainer = FlexGroupGRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                                   flexgroup_backend=args.backend)
    trainer.train()
    print("\nflexgroup token counts (grouped vs stock TRL forward):")
    print(trainer.flexgroup_report())
    return check(trainer, dataset["prompt"][:2], args.num_generations)


def check(trainer, prompts: list[str], group_size: int) -> int:
    """The trained policy, grouped vs each [prompt; completion] alone through an unpatched copy
    (:func:`flexgroup.verify`; completions of 1..16 random tokens); 0 if equivalent, else 1."""
    import flexgroup
    from flexgroup import GroupedBatch

    model = trainer.model
    ids = [trainer.processing_class(p, return_tensors="pt")["input_ids"][0] for p in prompts]
    g = torch.Generator().manual_seed(1)
    vocab = model.get_input_embeddings().num_embeddings
    lens = torch.randint(1, 17, (len(ids), group_size), generator=g)
    responses = [[torch.randint(3, vocab, (int(n),), generator=g) for n in row] for row in lens]
    report = flexgroup.verify(model, GroupedBatch.from_groups(ids, responses))
    print("\ncheck: the trained policy, grouped vs each [prompt; completion] alone (flexgroup.verify):")
    print(report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
