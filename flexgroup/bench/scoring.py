"""P9: scoring workloads -- multiple-choice log-likelihoods and a reward-model pass, per request vs shared.

Workloads (inference, ``torch.no_grad()``, random-weight Llama ``llama256``: hidden 256, 4 layers,
8/4 heads, vocab 1024):

- ``mc``: 4-choice questions as an evaluation harness sends them: one few-shot context of 1-2K
  tokens shared by every question, a question stem of 32-96 tokens, choices of 10-60 tokens; the
  result is ``(log-likelihood, is_greedy)`` per request.
- ``rm``: a reward model (``LlamaForSequenceClassification``, the same backbone) scoring G = 8
  responses of 64-256 tokens to one 1,024-token prompt.

Contenders (each checked against ``per-request`` before it is timed):

- ``per-request``: the stock model, one call per ``[context; continuation]`` (lm-eval's HFLM with
  ``batch_size=1``; for ``mc`` the LM head runs on the continuation rows only, ``logits_to_keep``);
- ``padded``: the stock model, one right-padded batch per question (``mc``, 4 rows) or for the G
  responses (``rm``; pooled at each row's last non-pad token, as a reward function does);
- ``flexgroup``: ``flexgroup.train.evaluation.loglikelihood`` / ``flexgroup.score`` (one packed row: the
  trie shares the few-shot block across questions and each question's stem across its choices).

Reported: tokens, the ideal speedup over ``per-request`` from ``Layout.cost()`` (decoder FLOPs), medians
of interleaved rounds (wall and process CPU time).

    flexgroup bench scoring [--rounds 5] [--threads 1] [--quick] [--out benchmarks/results/scoring-1t.json]
"""

from __future__ import annotations

import argparse
import copy
import random
import sys

import torch

import flexgroup
from flexgroup import GroupedBatch
from .harness import MODELS, build_model
from .measure import environment, finish_workload, interleaved_medians
from ..train.evaluation import loglikelihood
from ..models.zoo import ideal_speedup


def mc_requests(seed: int, questions: int, shots=(1024, 2048), stem=(32, 96), choice=(10, 60), vocab: int = 1024):
    """``questions`` x 4 ``(context, continuation)`` pairs of LongTensors, question by question."""
    rng = random.Random(seed)

    def toks(lo_hi):
        return torch.tensor([rng.randrange(1, vocab) for _ in range(rng.randint(*lo_hi))])

    few_shot = toks(shots)
    pairs = []
    for _ in range(questions):
        ctx = torch.cat([few_shot, toks(stem)])
        pairs += [(ctx, toks(choice)) for _ in range(4)]
    return pairs


def rm_requests(seed: int, prompt: int = 1024, group: int = 8, response=(64, 256), vocab: int = 1024):
    rng = random.Random(seed + 1)
    p = torch.tensor([rng.randrange(1, vocab) for _ in range(prompt)])
    return p, [torch.tensor([rng.randrange(1, vocab) for _ in range(rng.randint(*response))]) for _ in range(group)]


# ------------------------------------------------------------------------------ multiple choice
def mc_per_request(model, pairs):
    out = []
    for ctx, cont in pairs:
        ids = torch.cat([ctx, cont])[None]
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(cont) + 1).logits[0, :-1]
        lp = torch.log_softmax(logits, -1)
        out.append((float(lp.gather(1, cont[:, None]).sum()), bool((lp.argmax(-1) == cont).all())))
    return out


def mc_padded(model, pairs, per_batch: int = 4):
    out = []
    for a in range(0, len(pairs), per_batch):
        chunk = pairs[a:a + per_batch]
        seqs = [torch.cat([c, x]) for c, x in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        att = torch.zeros_like(ids)
        for k, s in enumerate(seqs):
            ids[k, :len(s)], att[k, :len(s)] = s, 1
        logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits
        for k, (c, x) in enumerate(chunk):
            lp = torch.log_softmax(logits[k, len(c) - 1:len(c) + len(x) - 1], -1)
            out.append((float(lp.gather(1, x[:, None]).sum()), bool((lp.argmax(-1) == x).all())))
    return out


# ------------------------------------------------------------------------------ reward model
def rm_per_request(model, prompt, responses):
    return torch.stack([model(input_ids=torch.cat([prompt, r])[None], use_cache=False).logits[0] for r in responses])


def rm_padded(model, prompt, responses):
    seqs = [torch.cat([prompt, r]) for r in responses]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), model.config.pad_token_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for k, s in enumerate(seqs):
        ids[k, :len(s)], att[k, :len(s)] = s, 1
    return model(input_ids=ids, attention_mask=att, use_cache=False).logits


def _classifier(lm):
    from transformers import LlamaForSequenceClassification

    cfg = copy.deepcopy(lm.config)
    cfg.num_labels, cfg.pad_token_id = 1, 0
    rm = LlamaForSequenceClassification(cfg).eval()
    rm.model.load_state_dict(lm.model.state_dict())
    return rm


def _run(name: str, contenders: dict, check, batch, config, rounds: int) -> dict:
    ref = None
    rec = {"ideal": ideal_speedup(config, batch.layout, batch.sequence_ends),
           "tokens": {"per-request": batch.cost().baseline_tokens, "flexgroup": batch.num_tokens}, "results": {}}
    with torch.no_grad():
        for n, fn in contenders.items():
            got = fn()
            ref = got if ref is None else ref
            err = check(got, ref)
            rec["results"][n] = {"max_abs_err": err}
            print(f"{name} {n:>12}: checked (max abs err {err:.2e})", file=sys.stderr)
        times = interleaved_medians(contenders, repeats=rounds)
    base = times["per-request"]
    for n in contenders:
        r = rec["results"][n]
        r.update(times[n])
        r.update(speedup=base["median_s"] / r["median_s"], speedup_cpu=base["median_cpu_s"] / r["median_cpu_s"])
    return rec


def _mc_check(got, ref):
    if [g for _, g in got] != [g for _, g in ref]:
        raise AssertionError("is_greedy differs from per-request")
    err = max(abs(a - b) for (a, _), (b, _) in zip(got, ref))
    if not err <= 1e-3:
        raise AssertionError(f"log-likelihoods differ from per-request by {err:.3g}")
    return err


def _rm_check(got, ref):
    err = (got - ref).abs().max().item()
    if not err <= 1e-4:
        raise AssertionError(f"reward logits differ from per-request by {err:.3g}")
    return err


def table(rec: dict) -> str:
    lines = ["| workload | contender | median s (wall) | median s (CPU) | speedup wall | speedup CPU | ideal | "
             "wall / ideal | max abs err |", "|---|---|---|---|---|---|---|---|---|"]
    for w, wr in rec["workloads"].items():
        for n, r in wr["results"].items():
            i = wr["ideal"] if n == "flexgroup" else None
            ideal, of_ideal = (f"{i:.2f}x", f"{r['speedup'] / i:.2f}") if i else ("", "")
            lines.append(f"| {w} | {n} | {r['median_s']:.3f} | {r['median_cpu_s']:.3f} | {r['speedup']:.2f}x | "
                         f"{r['speedup_cpu']:.2f}x | {ideal} | {of_ideal} | {r['max_abs_err']:.1e} |")
    for w, wr in rec["workloads"].items():
        t = wr["tokens"]
        lines.append(f"\n{w}: {wr['requests']} requests, tokens per request summed {t['per-request']:,}, "
                     f"packed {t['flexgroup']:,}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``flexgroup bench scoring ...`` (the options: :func:`flexgroup.bench.options.parser`)."""
    from .options import parser

    return run(parser("scoring").parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the workload with parsed ``args``; returns the exit status."""
    torch.set_num_threads(args.threads)
    extra = list(filter(None, args.backends.split(",")))
    q = 8 if args.quick else 1
    lm = build_model("llama256").eval()
    pairs = mc_requests(args.seed, args.questions, shots=(1024 // q, 2048 // q), stem=(32 // q, 96 // q),
                        choice=(max(2, 10 // q), 60 // q))
    patched = flexgroup.patch(copy.deepcopy(lm), backend="auto")
    mc_batch = GroupedBatch.from_sequences([torch.cat(p) for p in pairs])
    rec = {"model": MODELS["llama256"], "environment": environment(), "rounds": args.rounds, "workloads": {}}
    mc = {"per-request": lambda: mc_per_request(lm, pairs), "padded": lambda: mc_padded(lm, pairs),
          "flexgroup": lambda: loglikelihood(patched, pairs, max_tokens=None)}
    for b in extra:
        m_b = flexgroup.patch(copy.deepcopy(lm), backend=b)
        mc[f"flexgroup-{b}"] = lambda m_b=m_b: loglikelihood(m_b, pairs, max_tokens=None)
    rec["workloads"]["mc"] = _run("mc", mc, _mc_check, mc_batch, lm.config, args.rounds)
    rec["workloads"]["mc"]["requests"] = len(pairs)

    rm = _classifier(lm)
    prompt, responses = rm_requests(args.seed, prompt=1024 // q, response=(64 // q, 256 // q))
    rm_patched = flexgroup.patch(copy.deepcopy(rm), backend="auto")
    rm_batch = GroupedBatch.from_groups([prompt], [responses])
    rmc = {"per-request": lambda: rm_per_request(rm, prompt, responses),
           "padded": lambda: rm_padded(rm, prompt, responses),
           "flexgroup": lambda: flexgroup.score(rm_patched, [prompt], [responses]).class_logits}
    for b in extra:
        m_b = flexgroup.patch(copy.deepcopy(rm), backend=b)
        rmc[f"flexgroup-{b}"] = lambda m_b=m_b: flexgroup.score(m_b, [prompt], [responses]).class_logits
    rec["workloads"]["rm"] = _run("rm", rmc, _rm_check, rm_batch, lm.config, args.rounds)
    rec["workloads"]["rm"]["requests"] = len(responses)
    return finish_workload(rec, table(rec), args.out)


if __name__ == "__main__":
    sys.exit(main())
