"""lm-evaluation-harness through flexgroup, offline, on a task read from a local file.

Builds a tiny random checkpoint and a multiple-choice task (a JSONL file and its task YAML) in a
temporary folder, then runs the same task with lm-eval's own ``hf`` model and with ``flexgroup``
(each question's choices share its context, every question shares the few-shot block) and prints
both results and the largest log-likelihood difference. Nothing is downloaded:

    pip install -e ".[eval]"      # from the flexgroup checkout
    python examples/lm_eval_local.py

``--model DIR`` evaluates your own local checkpoint instead. The device is CUDA when available, else
the CPU (lm-eval's own default is CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

TASK_YAML = """task: flexgroup_letters
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
fewshot_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def write_task(folder: pathlib.Path, n: int = 8) -> str:
    """A multiple-choice task of ``n`` letter questions: ``folder/letters.jsonl`` and its YAML; returns its name."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    with open(folder / "letters.jsonl", "w") as f:
        for i in range(n):
            stem = " ".join(letters[(i + k) % 26] for k in range(4))
            choices = [" " + letters[(i + 4 + d) % 26] for d in (0, 3, 7)]
            f.write(json.dumps({"question": stem, "choices": choices, "answer": 0}) + "\n")
    (folder / "flexgroup_letters.yaml").write_text(TASK_YAML.format(data=folder / "letters.jsonl"))
    return "flexgroup_letters"


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a local checkpoint directory with its tokenizer "
                    "(default: a tiny random one built here)")
    ap.add_argument("--num-fewshot", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    import flexgroup.integrations.lm_eval  # noqa: F401  (registers the model "flexgroup")
    from flexgroup.models.checkpoints import save_tiny_checkpoint
    from flexgroup.cli import model_directory

    model = model_directory(args.model, tokenizer=True) if args.model else save_tiny_checkpoint()
    device = "cuda" if torch.cuda.is_available() else "cpu"   # lm-eval's hf model defaults to CUDA
    results = {}
    with tempfile.TemporaryDirectory(prefix="flexgroup_task_") as tmp:  # the task files, removed afterwards
        folder = pathlib.Path(tmp)
        task = write_task(folder)
        for name in ("hf", "flexgroup"):
            out = lm_eval.simple_evaluate(model=name, model_args=f"pretrained={model},dtype=float32",
                                          tasks=[task], num_fewshot=args.num_fewshot, batch_size=4, device=device,
                                          task_manager=TaskManager(include_path=str(folder)), log_samples=True)
            results[name] = out
            print(f"{name}: acc = {out['results'][task]['acc,none']:.4f}")
    lls = [[float(r[0]) for s in results[n]["samples"][task] for r in s["filtered_resps"]] for n in results]
    diff = max(abs(a - b) for a, b in zip(*lls))
    print(f"{len(lls[0])} choices scored; flexgroup vs lm-eval's hf model: max |log-likelihood diff| = {diff:.2e}")
    return 0 if diff <= 1e-4 else 1


def main(argv=None) -> int:
    """Exit 0 when flexgroup matches lm-eval's hf model, 1 if not, 2 with a one-line error for a bad ``--model``."""
    from flexgroup.cli import run_script

    return run_script("lm_eval_local.py", run, argv)


if __name__ == "__main__":
    sys.exit(main())
