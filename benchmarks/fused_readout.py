"""The fused readout (issue 39 item 2) at a real vocabulary: memory and time against the logits readouts.

    python benchmarks/fused_readout.py [--vocab 151936 --hidden 128] [--out benchmarks/results/fused-readout-1t]
    python benchmarks/fused_readout.py --table benchmarks/results/fused-readout-1t.json   # its Markdown

The tree: ``flexgroup bench dta``'s AReaL-DTA shape (one trajectory per turn, 17 turns, every token but the first
scored) with AReaL-DTA's system / thinking / response of 1000 / 500 / 200 tokens times ``s``: at ``s = 1`` a
16,100-token trie (the responses twice: after their thinking, and in the later turns' history) read 56,083 times. The model part is left out: the final hidden states are a leaf [rows, H] (N(0, 1)), the LM head
a leaf weight [V, H] (N(0, 1 / H)); one forward of the log-probs and one backward of a weighted sum. Contenders,
each in its own subprocess (one torch thread, float32):

- ``stock``: per trajectory its own hidden rows through the head, ``logits.gather - logsumexp(logits)`` (TRL's
  ``selective_log_softmax``): holds [reads, V] float32 logits for backward;
- ``unfused``: the trie's distinct rows through the head, :func:`flexgroup.data.readout.read_scores`: holds
  [rows, V];
- ``fused``: :func:`flexgroup.data.fused_readout.read_scores_fused`: holds the hidden states, the weight and
  [rows] statistics.

Per run: bytes saved for backward (distinct storages seen by ``saved_tensors_hooks``; the hidden states and the
weight, which exist anyway, reported apart), the process's peak RSS (``VmHWM``) and that peak before the
forward, forward and backward wall seconds. A contender whose logits would pass ``--max-gb`` runs only at the
smaller scales. Exactness (run after them): at ``s = 1/64``, float64 and float32, the largest difference of ``fused`` and
``unfused`` from ``stock`` in log-probs and in the gradients of the hidden states and the weight.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import torch
import torch.nn.functional as F

from flexgroup import GroupedBatch
from flexgroup.bench.measure import SavedForBackward, peak_rss_bytes, write_json
from flexgroup.bench.dta import dta_tree
from flexgroup.data.fused_readout import LMHead, read_scores_fused
from flexgroup.data.readout import read_plan, read_scores

FULL = dict(system=1000, thinking=500, response=200, turns=17)   # AReaL-DTA's own sizes: a 16,100-token trie
SCALES = ["1/32", "1/16", "1/8", "1/4", "1/2", "1"]


def _sizes(scale: float) -> dict:
    return {k: (max(1, round(v * scale)) if k != "turns" else v) for k, v in FULL.items()}


def tree_reads(scale: float) -> tuple[GroupedBatch, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The scaled DTA tree: its batch, the reads in trajectory-major order (packed-row index of the row that
    predicts the token [T], the token [T]) and per trajectory its reads' rows (a split of the first)."""
    batch = GroupedBatch.from_sequences(dta_tree(**_sizes(scale), vocab=1000))
    pred, tgt, flat = batch.read_index(torch.device("cpu"), needed_only=False)   # [T] each
    order = torch.argsort(flat)                                                  # trajectory-major, in token order
    pred, tgt, seq = pred[order], tgt[order], flat[order] // batch.max_len
    paths = list(torch.split(pred, torch.bincount(seq, minlength=batch.num_responses).tolist()))
    return batch, pred, tgt, paths


def _readout(name: str, h, w, pred, tgt, paths):
    """The log-probs [T] of one contender, differentiable w.r.t. ``h`` [L, H] and ``w`` [V, H]."""
    if name == "stock":
        lps, at = [], 0
        for rows in paths:
            x = F.linear(h[rows], w)                                           # [S_i, V] this trajectory's logits
            t = tgt[at: at + rows.numel()]
            lps.append(x.gather(1, t[:, None])[:, 0] - torch.logsumexp(x, -1))
            at += rows.numel()
        return torch.cat(lps)
    plan = read_plan(pred, tgt)
    if name == "unfused":
        x = F.linear(h.index_select(0, plan.rows), w)                           # [R, V] the distinct rows' logits
        return read_scores(x, plan._replace(rows=torch.arange(plan.rows.numel())))[0]
    return read_scores_fused(h, LMHead(w), plan)[0]


def one(name: str, scale: float, vocab: int, hidden: int, dtype=torch.float32) -> dict:
    torch.set_num_threads(1)
    batch, pred, tgt, paths = tree_reads(scale)
    assert sum(p.numel() for p in paths) == pred.numel()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(batch.num_tokens, hidden, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, dtype=dtype) / hidden ** 0.5).requires_grad_()
    u = torch.linspace(-1, 1, pred.numel(), dtype=dtype)
    base_rss = peak_rss_bytes()
    t0 = time.perf_counter()
    with SavedForBackward() as saved:
        lp = _readout(name, h, w, pred, tgt, paths)
    t1 = time.perf_counter()
    (lp * u).sum().backward()
    t2 = time.perf_counter()
    inputs = {h.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}
    held = saved.bytes
    return dict(contender=name, scale=scale, trie_tokens=batch.num_tokens, reads=pred.numel(),
                distinct_rows=int(torch.unique(pred).numel()), vocab=vocab, hidden=hidden,
                saved_bytes=held, saved_bytes_beyond_inputs=held - sum(n for k, (n, _) in saved.storages.items() if k in inputs),
                rss_before_bytes=base_rss, peak_rss_bytes=peak_rss_bytes(),
                forward_s=t1 - t0, backward_s=t2 - t1, lp=lp.detach(), grads=(h.grad, w.grad))


def exact(vocab: int, hidden: int) -> dict:
    """float64 and float32 at s = 1/64: each contender's largest difference from ``stock`` (values and gradients)."""
    out = {}
    for dtype in (torch.float64, torch.float32):
        runs = {n: one(n, 1 / 64, vocab, hidden, dtype) for n in ("stock", "unfused", "fused")}
        ref = runs["stock"]
        for n in ("unfused", "fused"):
            r = runs[n]
            out[f"{n}-{str(dtype)[6:]}"] = dict(
                logprobs=float((r["lp"] - ref["lp"]).abs().max()),
                grad_hidden=float((r["grads"][0] - ref["grads"][0]).abs().max()),
                grad_weight=float((r["grads"][1] - ref["grads"][1]).abs().max()),
                grad_hidden_scale=float(ref["grads"][0].abs().max()), grad_weight_scale=float(ref["grads"][1].abs().max()))
        fu, un = runs["fused"], runs["unfused"]
        out[f"fused-vs-unfused-{str(dtype)[6:]}"] = dict(
            logprobs=float((fu["lp"] - un["lp"]).abs().max()),
            grad_hidden=float((fu["grads"][0] - un["grads"][0]).abs().max()),
            grad_weight=float((fu["grads"][1] - un["grads"][1]).abs().max()))
    return out


def logit_gb(name: str, scale: float, vocab: int) -> float:
    """The float32 logits a contender holds (reads or distinct rows times V), GB; 0 for ``fused``."""
    if name == "fused":
        return 0.0
    sizes = _sizes(scale)
    s, th, r, n = sizes["system"], sizes["thinking"], sizes["response"], sizes["turns"]
    rows = n * (s + th + r) + r * n * (n - 1) // 2 if name == "stock" else s + n * (th + r) + (n - 1) * r
    return rows * vocab * 4 / 1e9


def table(rec: dict) -> str:
    """The Markdown of a result record: one row per run, then the exactness."""
    mib = 2 ** 20
    lines = [f"# Fused readout: vocab {rec['vocab']:,}, hidden {rec['hidden']}, {rec['dtype']}, {rec['threads']} thread",
             "", "AReaL-DTA-shaped tree (17 turns; system / thinking / response 1000 / 500 / 200 tokens times s: s = 1 is AReaL-DTA's size), every "
             "token but the first scored; a forward of the log-probs and a backward of a weighted sum, each contender "
             "in its own process (`python benchmarks/fused_readout.py`). Saved: bytes held for backward (beside "
             "them, beyond the hidden states and the head's weight, which exist anyway). Peak RSS: the process's, "
             "after the inputs (before the forward) in brackets.", "",
             "| s | trie tokens | reads | contender | saved for backward MiB (beyond h, W) | peak RSS GiB (before) "
             "| forward s | backward s |", "|---|---|---|---|---|---|---|---|"]
    for r in rec["runs"]:
        lines.append(f"| {r['scale']} | {r['trie_tokens']:,} | {r['reads']:,} | {r['contender']} | "
                     f"{r['saved_bytes'] / mib:,.1f} ({r['saved_bytes_beyond_inputs'] / mib:,.1f}) | "
                     f"{r['peak_rss_bytes'] / 2**30:.2f} ({r['rss_before_bytes'] / 2**30:.2f}) | "
                     f"{r['forward_s']:.1f} | {r['backward_s']:.1f} |")
    for sk in rec["skipped"]:
        lines.append(f"| {sk['scale']} | | | {sk['contender']} | not run: its float32 logits would be "
                     f"{sk['logits_gb']:.1f} GB | | | |")
    lines += ["", "Exactness at s = 1/64 (largest absolute difference; `stock` is the reference):", "",
              "| pair | log-probs | grad hidden | grad weight |", "|---|---|---|---|"]
    for k, v in rec["exactness"].items():
        lines.append(f"| {k} | {v['logprobs']:.2g} | {v['grad_hidden']:.2g} | {v['grad_weight']:.2g} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--max-gb", type=float, default=3.0, help="largest logits (GB, float32) a contender may hold; "
                    "its backward adds as much again for their gradient")
    ap.add_argument("--scales", default=",".join(SCALES))
    ap.add_argument("--one", nargs=2, metavar=("CONTENDER", "SCALE"), help=argparse.SUPPRESS)
    ap.add_argument("--exact", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="write STEM.json and STEM.md")
    ap.add_argument("--table", default=None, metavar="JSON", help="only print the Markdown of a result file")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())), end="")
        return 0
    if args.one:
        r = one(args.one[0], float(Fraction(args.one[1])), args.vocab, args.hidden)
        print(json.dumps({k: v for k, v in r.items() if k not in ("lp", "grads")}))
        return 0
    if args.exact:
        print(json.dumps(exact(args.vocab, args.hidden)))
        return 0
    cmd = [sys.executable, __file__, "--vocab", str(args.vocab), "--hidden", str(args.hidden)]
    runs, skipped = [], []
    for sc in args.scales.split(","):
        for name in ("stock", "unfused", "fused"):
            gb = logit_gb(name, float(Fraction(sc)), args.vocab)
            if gb > args.max_gb:
                skipped.append(dict(contender=name, scale=sc, logits_gb=gb))
                print(f"skip {name} at s={sc}: its logits would be {gb:.1f} GB", flush=True)
                continue
            res = subprocess.run(cmd + ["--one", name, sc], capture_output=True, text=True, check=True)
            runs.append(dict(json.loads(res.stdout.strip().splitlines()[-1]), scale=sc))
            r = runs[-1]
            print(f"{name:8s} s={sc:5s} tokens {r['trie_tokens']:6d} reads {r['reads']:6d}: saved "
                  f"{r['saved_bytes'] / 2**20:9.1f} MiB (beyond h, W {r['saved_bytes_beyond_inputs'] / 2**20:9.1f}), "
                  f"peak RSS {r['peak_rss_bytes'] / 2**30:6.2f} GiB (before {r['rss_before_bytes'] / 2**30:5.2f}), "
                  f"fwd {r['forward_s']:6.2f} s bwd {r['backward_s']:6.2f} s", flush=True)
    res = subprocess.run(cmd + ["--exact"], capture_output=True, text=True, check=True)
    rec = dict(vocab=args.vocab, hidden=args.hidden, threads=1, dtype="float32", tree=FULL, max_gb=args.max_gb,
               runs=runs, skipped=skipped, exactness=json.loads(res.stdout.strip().splitlines()[-1]),
               torch=torch.__version__)
    print(json.dumps(rec["exactness"], indent=1))
    if args.out:
        write_json(rec, args.out + ".json")
        Path(args.out + ".md").write_text(table(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
