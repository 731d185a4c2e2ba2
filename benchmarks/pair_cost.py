"""Per-pair cost of each attention kernel on the P7 trie (issue 25): ns per needed (query, key) pair-layer.

    python benchmarks/pair_cost.py [--rounds 3] [--quick] [--out benchmarks/results/pair-cost-1t.json]

Attention alone, forward+backward, P7's batch (``flexgroup bench trees``: 32 agentic sequences, trie of
19,407 tokens) with P7's model heads (4 query / 2 KV heads of 32), float32, 1 torch thread, process CPU
time, interleaved rounds (the machine is shared). Contenders:

- ``alone``: every sequence by itself through the fused causal kernel (``F.scaled_dot_product_attention``,
  ``is_causal=True``), as the stock model runs it; its pairs are the baseline's (every sequence's causal pairs);
- ``sdpa``: flexgroup's sdpa backend on the trie (masked per-segment calls);
- ``lse``: flexgroup's lse backend on the trie (mask-free fused parts merged by log-sum-exp).

"needed" pairs: the causal pairs each contender must compute (``Layout.cost()``: baseline pairs for
``alone``, the trie's grouped pairs for the others); the kernel may compute more (padding, the causal
kernel's coarse upper-triangle skipping), which is what the number shows.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from flexgroup import GroupedBatch
from flexgroup.bench.measure import environment, time_interleaved, write_json
from flexgroup.bench.trees import agentic_batch
from flexgroup.kernels import attention


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="P7's --quick lengths (every length / 8)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    lengths = dict(system=(128, 256), task=(32, 64), assistant=(8, 16), tool=(16, 32)) if args.quick else {}
    seqs, masks, _ = agentic_batch(0, vocab=128, **lengths)
    lay = GroupedBatch.from_sequences(seqs, masks).layout
    cost = lay.cost()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, lay.num_tokens, 32, generator=g).requires_grad_() for h in (4, 2, 2))
    paths = lay.paths()
    alone_qkv = [tuple(x[:, :, p].detach().requires_grad_() for x in (q, k, v)) for p in paths]

    def alone():
        for a, b, c in alone_qkv:
            F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True).sum().backward()

    def backend(name):
        return lambda: attention(q, k, v, lay, backend=name).sum().backward()

    steps = {"alone": alone, "sdpa": backend("sdpa"), "lse": backend("lse")}
    pairs = {"alone": cost.baseline_pairs, "sdpa": cost.grouped_pairs, "lse": cost.grouped_pairs}
    cpu: dict = {}
    time_interleaved(steps, repeats=args.rounds, warmup=1, cpu_times=cpu)
    rec = dict(environment=environment(), tokens=lay.num_tokens, segments=lay.num_segments, heads=[4, 2, 32],
               rounds=args.rounds, pairs=pairs, results={})
    for n in steps:
        t = statistics.median(cpu[n])
        rec["results"][n] = dict(median_cpu_s=t, cpu_s=cpu[n], ns_per_needed_pair_layer=t / pairs[n] * 1e9)
        print(f"{n:>6}: {t:.3f} s CPU, {pairs[n]:,} needed pairs, {t / pairs[n] * 1e9:.1f} ns per needed pair-layer")
    if args.out:
        write_json(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
