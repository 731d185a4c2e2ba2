"""P10: a group or tree bigger than the budget -- each alone vs one packed row vs streamed under a token budget.

The batch (``--workload``, :mod:`flexgroup.bench.stream_workloads`): ``group`` (default) is one
prompt of 4,096 tokens and G = 16 responses of 1,024 (``--quick``: 512, 4 x 128), the loss an
advantage-weighted sum of the responses' log-probs; ``tree`` is a 2,048-token system prompt shared by
3 user prompts, each with 8 three-turn trajectories that branch at turn boundaries and in the middle of
a turn, loss on the assistant tokens. The model (``--model``): a small random-weight Llama (hidden
128, 2 layers, 4 query / 2 KV heads, MLP 512, vocab 128; default) or a Qwen3.5-shaped hybrid of the
same width (3 Gated DeltaNet layers + 1 full-attention layer; same batch sizes), float32, training
mode, one torch thread. Contenders, each one forward+backward, checked against ``alone`` first:

- ``alone``: the stock model, one call per sequence ``[P; R_i]``, backward after each;
- ``packed``: ``flexgroup.patch`` + ``GroupedBatch.from_sequences``, one forward of the whole row;
- ``stream-<B>``: ``flexgroup.stream_backward`` with ``budget=B`` (2,048 and 8,192; quick: 256
  and 1,024): the shared prefix runs once, its keys and values (and, in the hybrid, its recurrent and
  conv states) are kept, the rest runs in forwards of at most ``B`` tokens, and the prefix's backward
  runs once at the end.

Reported: process CPU time (medians of interleaved rounds; the machine may be shared, CPU time does
not count time spent descheduled), the ideal speedup over ``alone`` from ``Layout.cost()``, and peak
memory two ways: the most bytes autograd holds for backward at any moment (saved-tensor hooks that
track when each saved tensor is released; parameters excluded) and the peak RSS (``VmHWM``) of a
fresh subprocess that builds the model, the batch and that contender only and runs one step, with its
RSS after the setup beside it (what the step adds is the difference).

    flexgroup bench stream [--workload group|tree] [--model llama|hybrid] [--quick] [--rounds 3]
                           [--out benchmarks/results/stream-1t.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import flexgroup
from flexgroup import GroupedBatch
from .measure import environment, held_peak, interleaved_medians, peak_rss_bytes, write_json
from . import stream_workloads as wl

MODEL = wl.LLAMA
SIZES = {"full": dict(wl.SIZES[("group", "llama")], budgets=wl.BUDGETS["full"]),
         "quick": dict(wl.SIZES[("group", "quick")], budgets=wl.BUDGETS["quick"])}


class Alone:
    """One stock call per sequence, backward after each."""

    def __init__(self, model, seqs, masks, w):
        self.model, self.seqs, self.masks, self.w = model, seqs, masks, w
        self.width = max(s.numel() for s in seqs)

    def _lp(self, s, m):
        first = int(torch.nonzero(m)[0])
        logits = self.model(input_ids=s[None], use_cache=False, logits_to_keep=s.numel() - first + 1).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, s[first:, None])[:, 0] * m[first:]
        return torch.nn.functional.pad(lp, (first, self.width - s.numel()))

    def logprobs(self):
        with torch.no_grad():
            return torch.stack([self._lp(s, m) for s, m in zip(self.seqs, self.masks)])

    def step(self):
        self.model.zero_grad(set_to_none=True)
        for s, m, w in zip(self.seqs, self.masks, self.w):
            (self._lp(s, m) * w).sum().backward()


class Packed:
    """The whole trie in one packed forward."""

    def __init__(self, model, seqs, masks, w):
        self.model, self.w = model, w
        self.batch = GroupedBatch.from_sequences(seqs, masks)
        self.inputs = self.batch.model_inputs(needed_logits_only=True)

    def _lp(self):
        return self.batch.logprobs(self.model(**self.inputs).logits)

    def logprobs(self):
        with torch.no_grad():
            return self._lp()

    def step(self):
        self.model.zero_grad(set_to_none=True)
        (self._lp() * self.w[:, None]).sum().backward()


class Streamed:
    """``flexgroup.stream_backward`` under ``budget``."""

    def __init__(self, model, seqs, masks, w, budget: int):
        self.model, self.seqs, self.masks, self.w, self.budget = model, seqs, masks, w, budget

    def logprobs(self):
        return flexgroup.stream_logprobs(self.model, self.seqs, loss_masks=self.masks, budget=self.budget)

    def step(self):
        self.model.zero_grad(set_to_none=True)
        flexgroup.stream_backward(self.model, self.seqs, lambda lp, i: (lp * self.w[i, None]).sum(),
                                  loss_masks=self.masks, budget=self.budget)


def contenders(model, seqs, masks, w, budgets) -> dict:
    patched = flexgroup.patch(copy.deepcopy(model))
    out = {"alone": Alone(copy.deepcopy(model), seqs, masks, w), "packed": Packed(patched, seqs, masks, w)}
    out.update({f"stream-{b}": Streamed(patched, seqs, masks, w, b) for b in budgets})
    return out


def _child(name: str, size: str, seed: int, work: str = "group", model_name: str = "llama") -> dict:
    """In a fresh process: build the model, batch and this contender only, then one step; peak RSS in bytes."""
    torch.set_num_threads(1)
    seqs, masks, w = wl.make_batch(work, wl.sizes(work, model_name, size == "quick"), seed)
    model = wl.build(model_name)
    if name == "alone":
        c = Alone(model, seqs, masks, w)
    elif name == "packed":
        c = Packed(flexgroup.patch(model), seqs, masks, w)
    else:
        c = Streamed(flexgroup.patch(model), seqs, masks, w, int(name.split("-")[1]))
    setup = peak_rss_bytes()
    c.step()
    return dict(rss_setup=setup, rss_peak=peak_rss_bytes())


def rss_in_subprocess(name: str, size: str, seed: int, work: str = "group", model_name: str = "llama") -> dict:
    root = str(Path(flexgroup.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "flexgroup.bench.stream", "--child", name, "--size", size,
                          "--seed", str(seed), "--workload", work, "--model", model_name],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    """``flexgroup bench stream ...`` (the options: :func:`flexgroup.bench.options.parser`)."""
    from .options import parser

    return run(parser("stream").parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the workload with parsed ``args``; returns the exit status."""
    if args.child:
        print(json.dumps(_child(args.child, args.size, args.seed, args.workload, args.model)))
        return 0
    torch.set_num_threads(args.threads)
    size = "quick" if args.quick else "full"
    sz, budgets = wl.sizes(args.workload, args.model, args.quick), wl.BUDGETS[size]
    seqs, masks, w = wl.make_batch(args.workload, sz, args.seed)
    model = wl.build(args.model)
    cs = contenders(model, seqs, masks, w, budgets)
    batch = cs["packed"].batch
    ideal = wl.ideal(args.model, model.config, batch)
    rec = dict(model=MODEL if args.model == "llama" else dict(wl.HYBRID, model_type="qwen3_5_text"),
               model_name=args.model, workload=args.workload, description=wl.describe(args.workload, args.model, sz),
               environment=environment(), size=size, **sz, budgets=list(budgets), sequences=len(seqs),
               alone_tokens=sum(s.numel() for s in seqs), packed_tokens=batch.layout.num_tokens,
               rounds=args.rounds, ideal={n: (1.0 if n == "alone" else ideal) for n in cs}, results={},
               load_average_start=os.getloadavg())
    ref = None
    for name, c in cs.items():
        lp = c.logprobs()
        ref = lp if ref is None else ref
        err = (lp - ref).abs().max().item()
        if not err <= args.atol:
            raise AssertionError(f"{name}: log-probs differ from alone by {err:.3g} > {args.atol}")
        params = list(c.model.parameters())
        rec["results"][name] = dict(max_abs_err=err, held_peak_bytes=held_peak(c.step, params))
        if not args.no_rss:
            rec["results"][name].update(rss_in_subprocess(name, size, args.seed, args.workload, args.model))
        print(f"{name:>12}: checked (max |dlogp| {err:.2e}), held for backward at peak "
              f"{rec['results'][name]['held_peak_bytes'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    for n, times in interleaved_medians({n: c.step for n, c in cs.items()}, repeats=args.rounds).items():
        rec["results"][n].update(times)
    _speedups(rec)
    rec["load_average_end"] = os.getloadavg()  # the machine may be shared: compare process CPU time
    print(table(rec))
    if args.out:
        write_json(rec, args.out)
    return 0


def _speedups(rec: dict) -> None:
    """``speedup`` (wall) and ``speedup_cpu`` of each contender over ``alone`` (what benchmarks/summarize.py reads)."""
    alone = rec["results"]["alone"]
    for r in rec["results"].values():
        r["speedup"] = alone["median_s"] / r["median_s"]
        r["speedup_cpu"] = alone["median_cpu_s"] / r["median_cpu_s"]


def table(rec: dict) -> str:
    """Markdown table of one run."""
    res = rec["results"]
    alone, packed = res["alone"], res["packed"]
    head = rec.get("description") or f"prompt {rec['prompt']}, G = {rec['groups']} responses of {rec['response']}"
    alone_tokens = f"{rec['alone_tokens']:,} tokens alone, " if "alone_tokens" in rec else ""
    lines = [f"{head}; {rec.get('sequences', rec.get('groups'))} sequences, {alone_tokens}packed row "
             f"{rec['packed_tokens']:,} tokens; budgets {rec['budgets']}", "",
             "| contender | CPU s (median) | speedup over alone (CPU) | ideal | of ideal | speed vs packed | "
             "held for backward (peak) | peak RSS (above setup) | RSS vs packed (above setup) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, r in res.items():
        sp = alone["median_cpu_s"] / r["median_cpu_s"]
        ideal = rec["ideal"][n]
        rss = r.get("rss_peak")
        rss_s = rel = "-"
        if rss and packed.get("rss_peak"):
            above, above_p = rss - r["rss_setup"], packed["rss_peak"] - packed["rss_setup"]
            rss_s = f"{rss / 2**20:.0f} MiB ({above / 2**20:.0f})"
            rel = f"{rss / packed['rss_peak']:.2f} ({above / max(above_p, 1):.2f})"
        lines.append(f"| {n} | {r['median_cpu_s']:.2f} | {sp:.2f}x | {ideal:.2f}x | {sp / ideal:.2f} | "
                     f"{packed['median_cpu_s'] / r['median_cpu_s']:.2f} | {r['held_peak_bytes'] / 2**20:.0f} MiB | "
                     f"{rss_s} | {rel} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
