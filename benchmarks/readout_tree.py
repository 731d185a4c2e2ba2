"""A fully scored multi-turn tree (AReaL-DTA's shape at CPU scale): the readout before and after sharing it.

    python benchmarks/readout_tree.py [--system 250 --thinking 125 --response 50 --turns 17] [--rounds 3]
                                      [--out benchmarks/results/readout-tree-1t]

The tree, model and contenders ``alone`` / ``trie`` are ``flexgroup bench dta``'s (flexgroup/bench/dta.py); one
torch thread. Added here, as the comparison only: ``before``, the trie with the readout flexgroup had before
issue 39 (one logit row copied and one log-softmax per read, :func:`per_read_logprobs`). All three timed in
interleaved rounds (median, wall and CPU), each a forward, the log-probs and a backward of a weighted sum.

Also, on the trie's logits alone: the readout's bytes saved for backward against the logits' bytes, its time
(forward + backward, median of the same rounds), and the largest difference of the shared readout from the
per-read one in log-probs and in the logits' gradient. The ideal beside: FLOPs of the decoder layers and the
LM head (``Workload.ideals``; 3.11x at the default size), and of the decoder layers alone.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from flexgroup import GroupedBatch
from flexgroup.bench.dta import SIZES, Workload
from flexgroup.bench.measure import time_interleaved, write_json
from flexgroup.bench.trees import Grouped


def per_read_logprobs(batch: GroupedBatch, logits: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """The readout before issue 39, for comparison only: per scored token its logit row copied and its own
    log-softmax. ``logits`` [1, K, V] of ``model_inputs(needed_logits_only=True)`` -> [N, max_len]."""
    pred, tgt, flat = batch.read_index(logits.device, needed_only=True)
    x2 = logits[0]
    lps = []
    for a in range(0, pred.numel(), chunk):
        x = x2.index_select(0, pred[a:a + chunk])                              # [c, V] a copy per read
        lps.append(x.gather(1, tgt[a:a + chunk, None])[:, 0] - torch.logsumexp(x, dim=-1))
    n, w = batch.num_responses, batch.max_len
    return x2.new_zeros(n * w).index_put((flat,), torch.cat(lps)).view(n, w)


class PerRead(Grouped):
    """The trie contender with :func:`per_read_logprobs` in place of ``batch.logprobs``."""

    def logprobs(self):
        return per_read_logprobs(self.batch, self.model(**self.inputs).logits) * self.cols


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in SIZES.items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write STEM.json and STEM.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    wl = Workload({k: getattr(args, k) for k in SIZES})
    b = wl.batch
    steps = {"alone": wl.contenders["alone"].step,
             "before": PerRead(wl.patched, b, wl.masks, None, wl.w, shift=False).step,
             "after": wl.contenders["trie"].step}
    cpu: dict = {}
    times = time_interleaved(steps, repeats=args.rounds, warmup=1, cpu_times=cpu)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}

    with torch.no_grad():
        fixed = wl.patched(**b.model_inputs(needed_logits_only=True)).logits   # [1, K, V]
    w = torch.linspace(-1.0, 1.0, b.max_len)
    reads = {"before": lambda x: per_read_logprobs(b, x), "after": b.logprobs}
    held = {k: wl.readout_bytes(read)[0] for k, read in reads.items()}
    xs = {k: fixed.clone().requires_grad_() for k in reads}
    lp_of, grad_of = {}, {}

    def readout(k, read):
        def step():
            xs[k].grad = None
            lp = read(xs[k])
            (lp * w).sum().backward()
            lp_of[k], grad_of[k] = lp.detach(), xs[k].grad
        return step

    readout_s = time_interleaved({k: readout(k, read) for k, read in reads.items()}, repeats=args.rounds, warmup=1)
    logit_bytes = fixed.numel() * fixed.element_size()
    ideals = wl.ideals()
    res = {
        "workload": {k: getattr(args, k) for k in SIZES}, "threads": 1, "rounds": args.rounds,
        "sequences": len(wl.seqs), "packed_tokens": b.num_tokens,
        "scored_reads": int(b.response_mask.sum()), "distinct_rows": b.logit_rows.numel(),
        "step_s": med, "step_cpu_s": med_cpu, "step_s_all": times, "step_cpu_s_all": cpu,
        "speedup_vs_alone": {k: med["alone"] / med[k] for k in reads},
        "speedup_cpu_vs_alone": {k: med_cpu["alone"] / med_cpu[k] for k in reads},
        "ideal_with_lm_head": ideals["with_lm_head"], "ideal_decoder_layers": ideals["decoder_layers"],
        "fraction_of_ideal_cpu": {k: med_cpu["alone"] / med_cpu[k] / ideals["with_lm_head"] for k in reads},
        "readout_saved_bytes": held, "logit_bytes": logit_bytes,
        "readout_saved_over_logits": {k: held[k] / logit_bytes for k in held},
        "readout_s": {k: statistics.median(v) for k, v in readout_s.items()},
        "after_vs_before_max_abs": {"logprobs": float((lp_of["after"] - lp_of["before"]).abs().max()),
                                    "logit_grad": float((grad_of["after"] - grad_of["before"]).abs().max())},
    }
    print(table(res))
    if args.out:
        write_json(res, args.out + ".json")
        Path(args.out + ".md").write_text(table(res))
    return 0


def table(r: dict) -> str:
    mib = 2 ** 20
    wl = r["workload"]
    lines = [f"# Fully scored multi-turn tree: system {wl['system']}, thinking {wl['thinking']}, response "
             f"{wl['response']}, {wl['turns']} turns",
             "",
             f"{r['sequences']} trajectories, {r['packed_tokens']} packed tokens, {r['scored_reads']} scored reads of "
             f"{r['distinct_rows']} distinct logit rows; 2-layer Llama hidden 128 vocab 2048, float32, 1 thread, "
             f"median of {r['rounds']} interleaved rounds (`python benchmarks/readout_tree.py`).",
             "",
             "| readout | step s wall / CPU (fwd + lp + bwd) | speedup vs alone wall / CPU | ideal (layers + LM head) "
             "| CPU / ideal | ideal (layers only) | readout saved for backward | / logits' bytes | readout s (fwd + bwd) |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| alone (stock, each trajectory) | {r['step_s']['alone']:.2f} / {r['step_cpu_s']['alone']:.2f} | 1.00x "
             "| | | | | | |"]
    for k in ("before", "after"):
        lines.append(f"| {k} | {r['step_s'][k]:.2f} / {r['step_cpu_s'][k]:.2f} | {r['speedup_vs_alone'][k]:.2f}x / "
                     f"{r['speedup_cpu_vs_alone'][k]:.2f}x | {r['ideal_with_lm_head']:.2f}x | "
                     f"{r['fraction_of_ideal_cpu'][k]:.2f} | {r['ideal_decoder_layers']:.2f}x | "
                     f"{r['readout_saved_bytes'][k] / mib:.1f} MiB | {r['readout_saved_over_logits'][k]:.2f} | "
                     f"{r['readout_s'][k]:.3f} |")
    d = r["after_vs_before_max_abs"]
    lines += ["", f"logits: {r['logit_bytes'] / mib:.1f} MiB. after vs before, max |diff|: log-probs {d['logprobs']:.2g}, "
              f"gradient of the logits {d['logit_grad']:.2g}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
