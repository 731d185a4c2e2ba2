"""Scoring with each shared prefix encoded once: a reward model over G responses, and multiple choice.

Runs offline out of the box (tiny random Llama checkpoints with a word-level tokenizer built here, CPU,
a few seconds); nothing is downloaded:

    python examples/scoring.py

With your own checkpoints (local directories with their tokenizer, or hub ids already in the local
cache): ``--reward-model`` a ``*ForSequenceClassification`` (one label: a reward model),
``--model`` a ``*ForCausalLM`` for the multiple-choice part:

    python examples/scoring.py --reward-model ./my-rm --model ./my-lm

Part 1 scores G responses to each prompt with ``flexgroup.score`` (the prompt encoded once per
group); part 2 answers multiple-choice questions with ``flexgroup.train.evaluation.multiple_choice`` (a
shared few-shot block and each question's stem encoded once for all its choices). Each part checks
itself against every sequence run alone through a separately loaded, unpatched copy of the model and
prints the largest difference.
"""

from __future__ import annotations

import argparse
import sys

import torch

import flexgroup
from flexgroup.train.evaluation import encode_pair, multiple_choice

PROMPTS = ["q w e r t y u i o p a s d f g h j k l z x c v b n m", "m n b v c x z l k j h g f d s a"]
RESPONSES = [["a b c", "x y", "a b c d e f", "z"], ["k", "o p q r", "s t"]]
FEW_SHOT = "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2
QUESTIONS = [("a b c d", [" e", " f", " z"]), ("x y", [" z", " a b", " c"]), ("m n o", [" p", " q r s", " t"])]


def _load(text: str, classifier: bool, dtype: torch.dtype):
    """(stock model, tokenizer) from a directory or a cached hub id, offline; one-line errors."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from transformers.utils import logging as hf_logging

    from flexgroup.cli import UsageError, model_directory

    hf_logging.disable_progress_bar()
    path = model_directory(text, tokenizer=True)
    cls = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    try:
        model = cls.from_pretrained(path, local_files_only=True, attn_implementation="sdpa", dtype=dtype)
        return model.eval(), AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {text}: transformers cannot load it: {' '.join(str(e).split())[:300]}") from e


def _ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]


def reward_model_part(path: str, dtype: torch.dtype) -> float:
    """Score G responses per prompt; return max |reward - reward of [P; R] alone| (stock model)."""
    scorer, tokenizer = _load(path, classifier=True, dtype=dtype)
    stock, _ = _load(path, classifier=True, dtype=dtype)             # never patched: the oracle
    prompts = [_ids(tokenizer, p) for p in PROMPTS]
    responses = [[_ids(tokenizer, r) for r in rs] for rs in RESPONSES]
    with torch.no_grad():
        s = flexgroup.score(scorer, prompts, responses)                # class_logits [N, num_labels]
        alone = torch.cat([stock(input_ids=torch.cat([p, r])[None]).logits
                           for p, rs in zip(prompts, responses) for r in rs])
    n = 0
    for g, rs in enumerate(RESPONSES):
        best = max(range(len(rs)), key=lambda j: float(s.class_logits[n + j, 0]))
        print(f"prompt {g}: rewards {[round(float(x), 4) for x in s.class_logits[n:n + len(rs), 0]]}, best "
              f"response {best} ({rs[best]!r})")
        n += len(rs)
    diff = float((s.class_logits - alone).abs().max())
    print(f"reward model: {s.grouped_tokens} tokens through the model instead of {s.baseline_tokens} "
          f"({s.rows} row(s)); check against each [prompt; response] alone: max |diff| = {diff:.2e}")
    return diff


def multiple_choice_part(path: str, dtype: torch.dtype) -> float:
    """Answer QUESTIONS after a shared few-shot block; return max |log-likelihood - alone|."""
    lm, tokenizer = _load(path, classifier=False, dtype=dtype)
    stock, _ = _load(path, classifier=False, dtype=dtype)
    questions = [(FEW_SHOT + stem, choices) for stem, choices in QUESTIONS]
    res = multiple_choice(lm, questions, tokenizer=tokenizer)          # per question: [(loglik, is_greedy)]
    diff = 0.0
    for (ctx, choices), r in zip(questions, res):
        answer = max(range(len(r)), key=lambda j: r[j][0])
        print(f"{ctx[len(FEW_SHOT):]!r}: log-likelihoods {[round(x, 4) for x, _ in r]} -> {choices[answer]!r}")
        for (ll, _), choice in zip(r, choices):
            c, x = (torch.tensor(ids) for ids in encode_pair(tokenizer, ctx, choice))  # as lm-eval splits them
            with torch.no_grad():
                logits = stock(input_ids=torch.cat([c, x])[None]).logits[0, c.numel() - 1:-1]
            ref = float(torch.log_softmax(logits.double(), -1).gather(1, x[:, None]).sum())
            diff = max(diff, abs(ll - ref))
    print(f"multiple choice: check against each [context; choice] alone: max |diff| = {diff:.2e}")
    return diff


def main(argv=None) -> int:
    """Exit 0 on success (scoring.py: 1 if its check fails), 2 with a one-line error for a bad ``--model``."""
    from flexgroup.cli import run_script

    return run_script("scoring.py", run, argv)


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reward-model", default=None, help="a *ForSequenceClassification checkpoint (default: "
                    "a tiny random one built here)")
    ap.add_argument("--model", default=None, help="a *ForCausalLM checkpoint for multiple choice (default: a "
                    "tiny random one built here)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--tol", type=float, default=None, help="largest accepted difference (default: 1e-4 in "
                    "float32, 1e-9 in float64)")
    args = ap.parse_args(argv)

    from flexgroup.models.checkpoints import save_tiny_checkpoint

    dtype = getattr(torch, args.dtype)
    tol = args.tol if args.tol is not None else (1e-4 if dtype == torch.float32 else 1e-9)
    d1 = reward_model_part(args.reward_model or save_tiny_checkpoint(num_labels=1), dtype)
    d2 = multiple_choice_part(args.model or save_tiny_checkpoint(), dtype)
    ok = max(d1, d2) <= tol
    print(f"equivalent: {'yes' if ok else 'no'} (tolerance {tol:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
