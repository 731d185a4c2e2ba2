"""DPO with TRL, each pair's prompt encoded once per model: ``FlexGroupDPOTrainer``.

Runs offline out of the box (a tiny random Llama policy and reference with a word-level tokenizer
built here, CPU, a few seconds):

    pip install -e ".[trl]"      # from the flexgroup checkout
    python examples/dpo.py --steps 2

With your own checkpoint (a local directory with its tokenizer, or a hub id already in the local
cache; nothing is downloaded):

    python examples/dpo.py --model ./my-checkpoint --steps 10

The only difference from a plain TRL script is the trainer class (``FlexGroupDPOTrainer`` instead of
``DPOTrainer``), or ``patch_dpo_trainer(trainer)`` on a trainer you already built. The report at
the end counts the decoder tokens of the policy and the reference model, grouped against stock TRL.

Then the example checks itself (exit status 1 when the check fails): one training batch's rows --
each pair's ``[prompt; chosen]`` and ``[prompt; rejected]`` -- packed as the adapter packs them (one
prefix trie: each prompt once) through a patched float32 copy of the trained policy, against each
row run alone through an unpatched float32 copy of the same weights; every log-prob of every row.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

TOLERANCE = 1e-4  # max |log-prob difference| in float32 (the stock model's own spread is ~1e-6 here)


def preference_pairs(n: int, seed: int = 0):
    """``n`` (prompt, chosen, rejected) rows of letter-words; every prompt appears twice (two pairs)."""
    from datasets import Dataset

    from flexgroup.models.checkpoints import LETTERS

    g = torch.Generator().manual_seed(seed)

    def words(k):
        return " ".join(LETTERS[int(i)] for i in torch.randint(0, 26, (k,), generator=g)) + " "

    prompts = [words(24 + 4 * i) for i in range((n + 1) // 2)]
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(n):
        rows["prompt"].append(prompts[i // 2])
        rows["chosen"].append(words(3 + i % 4))
        rows["rejected"].append(words(2 + (i + 1) % 5))
    return Dataset.from_dict(rows)


def main(argv=None) -> int:
    """Exit 0 on success, 1 when the check fails, 2 with a one-line error for a bad ``--model`` (as the
    ``flexgroup`` CLI)."""
    from flexgroup.cli import run_script

    return run_script("dpo.py", run, argv)


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="local checkpoint directory with its tokenizer, or a cached "
                    "hub id (default: a tiny random model built here)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=8, help="preference pairs in the data set (default 8)")
    ap.add_argument("--batch-size", type=int, default=4, help="pairs per micro-batch (default 4)")
    ap.add_argument("--backend", default="auto", help="flexgroup attention backend: auto, sdpa, flex")
    ap.add_argument("--output-dir", default=None, help="TRL's output directory (default: a temporary one, removed "
                    "at the end)")
    args = ap.parse_args(argv)

    from flexgroup.models.checkpoints import save_tiny_checkpoint
    from flexgroup.cli import model_directory
    from flexgroup.integrations.trl_dpo import FlexGroupDPOTrainer

    if args.model:
        model = ref = model_directory(args.model, tokenizer=True)
    else:
        model, ref = save_tiny_checkpoint(seed=0), save_tiny_checkpoint(seed=1)  # reference != policy
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    ref_model = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, attn_implementation="sdpa",
                                                     local_files_only=True)
    with tempfile.TemporaryDirectory(prefix="flexgroup_dpo_") as scratch:  # removed at the end
        config = _config(args, args.output_dir or scratch, dtype)
        trainer = FlexGroupDPOTrainer(model=model, ref_model=ref_model, args=config,
                                      train_dataset=preference_pairs(args.pairs), flexgroup_backend=args.backend)
        trainer.train()
    print("\nflexgroup token counts (grouped vs stock TRL forward):")
    print(trainer.flexgroup_report())
    return 0 if check(trainer, model, args.backend) <= TOLERANCE else 1


def _config(args, output_dir: str, dtype):
    from trl import DPOConfig

    return DPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=1e-4,
        beta=0.1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        model_init_kwargs={"dtype": dtype, "attn_implementation": "sdpa"},  # not a flash-attention kernel
    )


def check(trainer, model_dir: str, backend: str) -> float:
    """Print and return max |log-prob difference|: one training batch packed through a patched copy of the
    trained policy vs each of its rows alone through an unpatched copy (both float32, the trained weights)."""
    from transformers import AutoModelForCausalLM

    import flexgroup
    from flexgroup import GroupedBatch

    trained = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    device = next(iter(trained.values())).device

    def copy():
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                 local_files_only=True)
        m.load_state_dict({k: v.float() for k, v in trained.items()})
        return m.to(device).eval()

    inputs = next(iter(trainer.get_train_dataloader()))   # [2B, L]: chosen rows, then rejected rows
    ids, real = inputs["input_ids"].cpu(), inputs["attention_mask"].cpu().bool()
    rows = [ids[i][real[i]] for i in range(ids.shape[0])]   # [prompt; completion] of each row, padding dropped
    batch = GroupedBatch.from_sequences(rows)              # one prefix trie: each pair's prompt once
    grouped, stock = flexgroup.patch(copy(), backend=backend), copy()   # `stock` is never patched
    diff = 0.0
    with torch.no_grad():
        lp = batch.logprobs(grouped(**batch.model_inputs(device)).logits)   # [2B, max_len]; position 0 is 0
        for i, row in enumerate(rows):
            row = row.to(device)
            alone = stock(input_ids=row[None]).logits[0, :-1].log_softmax(-1)         # [len - 1, V]
            alone = alone.gather(-1, row[1:, None])[:, 0]                              # log p(row[t] | row[:t])
            diff = max(diff, float((lp[i, 1:len(row)] - alone).abs().max()))
    print(f"check: {len(rows)} rows ({batch.num_tokens} packed tokens instead of {sum(len(r) for r in rows)}), "
          f"grouped log-probs vs each [prompt; completion] alone: max |diff| = {diff:.2e}")
    print(f"equivalent: {'yes' if diff <= TOLERANCE else 'no'} (tolerance {TOLERANCE:.0e})")
    return diff


if __name__ == "__main__":
    sys.exit(main())
