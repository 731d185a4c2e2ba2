"""Bytes held for backward per rank when streaming on a sequence-parallel model, against one process streaming alone.

    python benchmarks/stream_sp_memory.py --ranks 1 2 4 --out benchmarks/results/stream-sp-memory.json

A measurement, not a timed test. One batch (P10's ``tree`` workload by default: a system prompt of
2,048 tokens shared by 3 user prompts, 24 three-turn trajectories branching mid-turn; ``--workload
group``: a 4,096-token prompt and 16 responses of 1,024) runs through ``flexgroup.stream_backward``
under ``--budget`` tokens per forward with P10's log-prob loss, on a small random Llama
(``flexgroup.models.zoo`` "demo" shape: hidden 256, MLP 1024, 8 query / 4 KV heads of 32, vocab 2048;
``--layers``). ``--ranks 1`` is one process (``patch(model)``); ``W > 1`` spawns W CPU processes (gloo,
127.0.0.1) with ``patch(model, sequence_parallel=group)``, each streaming the same schedule sharded.

Per rank:

- ``held``: the peak, over the whole call, of the bytes of distinct tensor storages autograd holds for
  backward (``saved_tensors_hooks``; parameters excluded) -- P10's "bytes held for backward": the
  pending chunks' graphs (which hold the kept keys and values) plus the running chunk's;
- ``peak_rss_delta``: peak resident set size (``VmHWM``) minus the resident size before the call;
- ``cpu_s``: process CPU time (1 torch thread per rank; on a shared machine: not a speed claim).

KV heads that do not divide by W are replicated (``f = W / gcd(KV heads, W)``): each rank then holds
``f / W`` of the kept keys and values instead of ``1 / W`` (``--kv-heads 2`` shows it at W = 4).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def measure(workload: str, budget: int, layers: int, kv_heads: int, quick: bool = False, group=None) -> dict:
    """One ``stream_backward`` call on this process (sharded over ``group`` unless None)."""
    import flexgroup
    from flexgroup.bench import stream_workloads as wl
    from flexgroup.bench.measure import held_peak, peak_rss_bytes, rss_bytes
    from flexgroup.models.zoo import build_model

    model = build_model("llama", size="demo", num_hidden_layers=layers, num_key_value_heads=kv_heads,
                        max_position_embeddings=65536).train()
    flexgroup.patch(model, sequence_parallel=group)
    make = wl.group_batch if workload == "group" else wl.tree_batch
    seqs, masks, w = make(**wl.sizes(workload, "llama", quick), vocab=model.config.vocab_size)
    total = int(sum(m.sum() for m in masks))

    def loss(lp, index):
        return -(lp * w[index, None].to(lp.dtype)).sum() / total

    res = {}

    def step():
        res["r"] = flexgroup.stream_backward(model, seqs, loss, loss_masks=masks, budget=budget)

    rss0, cpu0 = rss_bytes(), time.process_time()
    held = held_peak(step, list(model.parameters()))
    return {"held": held, "peak_rss_delta": peak_rss_bytes() - rss0,
            "cpu_s": time.process_time() - cpu0, "forwards": res["r"].forwards, "loss": res["r"].loss,
            "tokens": int(sum(s.numel() for s in seqs)),
            "packed_tokens": flexgroup.GroupedBatch.from_sequences(seqs, masks).num_tokens}


def main(argv=None) -> None:
    import tempfile

    from flexgroup.bench.measure import per_rank, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("tree", "group"), default="tree")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--quick", action="store_true", help="P10's quick (smoke-test) sizes")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    args = (a.workload, a.budget, a.layers, a.kv_heads, a.quick)
    rows = {}
    for w in a.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            rows[w] = per_rank(measure, args, w, tmp)
        print(f"ranks={w}: {rows[w]}", flush=True)
    base = rows.get(1, [None])[0]
    r0 = rows[a.ranks[0]][0]
    print(f"\n{a.workload} workload ({r0['tokens']} tokens over all sequences, {r0['packed_tokens']} packed), "
          f"budget {a.budget}, "
          f"Llama demo shape with {a.layers} layers and {a.kv_heads} KV heads, float32, CPU (gloo)\n")
    print("| ranks | forwards | held for backward (max rank) | x one process | target 1.15/ranks | "
          "peak RSS delta (max rank) | x one process | CPU s (max rank) |")
    print("|" + "---|" * 8)
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    for w, rs in rows.items():
        mx = {k: max(r[k] for r in rs) for k in ("held", "peak_rss_delta", "cpu_s")}
        rel = lambda k: f"{mx[k] / base[k]:.3f}" if base else "-"  # noqa: E731
        print(f"| {w} | {rs[0]['forwards']} | {mib(mx['held'])} | {rel('held')} | {1.15 / w:.3f} | "
              f"{mib(mx['peak_rss_delta'])} | {rel('peak_rss_delta')} | {mx['cpu_s']:.1f} |")
    if a.out:
        write_json({"workload": a.workload, "budget": a.budget, "layers": a.layers, "kv_heads": a.kv_heads,
                    "quick": a.quick, "ranks": rows}, a.out)


if __name__ == "__main__":
    main()
