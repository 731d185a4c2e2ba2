"""Per-rank activation memory of Ulysses sequence parallelism over a packed tree, against one process.

    python benchmarks/sp_memory.py --tokens 32768 --ranks 1 2 4 --out benchmarks/results/sp-memory.json

One packed tree (a root prompt, 4 branches, 2 sub-branches each: 1/4, 3/8, 3/8 of the tokens per
level) goes through a small random Llama (``flexgroup.models.zoo`` "demo" shape: hidden 256, MLP 1024, 8
heads, 4 KV heads, vocab 2048; ``--layers``) and a log-prob loss, forward and backward. ``--ranks 1``
is the single process (``flexgroup.patch(model)``, unsharded); ``W > 1`` spawns W CPU processes (gloo,
127.0.0.1) running ``patch(model, sequence_parallel=group)`` on ``model_inputs(shard=group)``.

Per rank it reports:

- ``saved_bytes``: bytes of the distinct tensor storages autograd holds for backward during the
  forward (``torch.autograd.graph.saved_tensors_hooks``; parameters excluded) -- the activations;
- ``peak_rss_delta``: peak resident set size (``VmHWM``) after forward+backward minus the resident
  size just before the forward (allocator caching and the kernels' temporaries included);
- ``cpu_s``: process CPU time of forward+backward (1 torch thread per rank).

Memory does not depend on machine load; the CPU times do (measured on a shared machine, not a speed
claim). Prints a markdown table; ``--out`` also writes JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def tree_layout(tokens: int):
    """Root of tokens/4, 4 children of 3 tokens/32, each with 2 children of 3 tokens/64 (sums to ``tokens``)."""
    from flexgroup import Layout

    root, child = tokens // 4, 3 * tokens // 32
    grand = (tokens - root - 4 * child) // 8
    root = tokens - 4 * child - 8 * grand
    parents, lengths = [-1], [root]
    for c in range(4):
        parents.append(0)
        lengths.append(child)
        me = len(parents) - 1
        for _ in range(2):
            parents.append(me)
            lengths.append(grand)
    return Layout.tree(parents, lengths)


def measure(tokens: int, layers: int, group=None, device: str = "cpu", backend: str = "auto") -> dict:
    """Forward + backward of one sharded (or, ``group=None``, unsharded) packed tree on this process."""
    import flexgroup
    from flexgroup import GroupedBatch
    from flexgroup.bench.measure import SavedForBackward, peak_rss_bytes, rss_bytes
    from flexgroup.models.zoo import build_model

    model = build_model("llama", size="demo", num_hidden_layers=layers,
                        max_position_embeddings=max(4096, tokens)).to(device)
    flexgroup.patch(model, backend=backend, sequence_parallel=group)
    layout = tree_layout(tokens)
    ids = torch.randint(3, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    scored = torch.ones(tokens, dtype=torch.bool)
    scored[:layout.lengths[0]] = False                      # the root prompt is not scored
    batch = GroupedBatch.from_layout(layout, ids, loss_mask=scored)
    vocab, head_dim = model.config.vocab_size, model.config.head_dim

    def kind(t) -> str:
        if t.shape[-1] == vocab:
            return "logprob"        # logits / log-prob rows [rows, V]
        if t.ndim == 4 and t.shape[1] == 1 and t.shape[-1] != head_dim:
            return "mask"           # the sdpa backend's [G, 1, n, m] masks (bool, or F.sdpa's float copy)
        return "model"

    inputs = batch.model_inputs(device, shard=group, needed_logits_only=True)
    cuda = device != "cpu"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss0, cpu0, gpu0 = rss_bytes(), time.process_time(), torch.cuda.memory_allocated() if cuda else 0
    with SavedForBackward(list(model.parameters()), kind) as saved:
        logits = model(**inputs).logits
        lp = batch.logprobs(logits, shard=group)
    by_kind = {k: saved.by_kind().get(k, 0) for k in ("model", "mask", "logprob")}
    saved_bytes = sum(by_kind.values())
    lp.sum().backward()
    cpu = time.process_time() - cpu0
    peak = peak_rss_bytes()
    out = {"saved_bytes": saved_bytes, **{f"saved_{k}": v for k, v in by_kind.items()},
           "peak_rss_delta": peak - rss0, "cpu_s": cpu,
           "local_tokens": inputs["input_ids"].shape[1]}
    if cuda:
        out["peak_gpu_delta"] = torch.cuda.max_memory_allocated() - gpu0
    return out


def torchrun_main(tokens: int, layers: int) -> int:
    """Multi-GPU recipe (``torchrun --nproc-per-node W``; NOT run here, no multi-GPU machine).

    1. Exactness: a tiny Llama (float32) on a small tree, sharded over all ranks, against the same
       batch unsharded on every rank: summed log-probs and summed gradients, printed by rank 0.
    2. Memory: :func:`measure` sharded over all ranks (peak CUDA allocation per rank included).
    """
    import torch.distributed as dist

    import flexgroup
    from flexgroup import GroupedBatch
    from flexgroup.models.zoo import build_model

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    group, rank, dev = dist.group.WORLD, dist.get_rank(), "cuda"
    lay = tree_layout(1000)
    ids = torch.randint(3, 128, (lay.num_tokens,), generator=torch.Generator().manual_seed(0))
    batch = GroupedBatch.from_layout(lay, ids)
    runs = []
    for g in (None, group):
        model = flexgroup.patch(build_model("llama").to(dev), sequence_parallel=g)
        lp = batch.logprobs(model(**batch.model_inputs(dev, shard=g)).logits, shard=g)
        lp.sum().backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        if g is not None:
            lp = lp.detach().clone()
            dist.all_reduce(lp)
            for t in grads:
                dist.all_reduce(t)
        runs.append((lp.detach(), grads))
    err = (runs[0][0] - runs[1][0]).abs().max().item()
    gerr = max(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item() for a, b in zip(runs[0][1], runs[1][1]))
    res = measure(tokens, layers, group, dev)
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, res)
    if rank == 0:
        print(f"sequence parallel over {len(got)} GPUs: log-prob error {err:.3g}, max relative grad error {gerr:.3g}")
        for r, x in enumerate(got):
            print(f"rank {r}: {x}")
    dist.destroy_process_group()
    return 0 if err < 1e-4 and gerr < 1e-3 else 1


def main(argv=None) -> None:
    import functools
    import tempfile

    from flexgroup.bench.measure import per_rank, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--backend", default="auto", help="flexgroup backend (auto: lse on CPU; sdpa keeps [G, 1, n, m] "
                    "segment masks, replicated on every rank)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = {}
    for w in a.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            rows[w] = per_rank(functools.partial(measure, backend=a.backend), (a.tokens, a.layers), w, tmp)
        print(f"ranks={w}: {rows[w]}", flush=True)
    base = rows.get(1, [None])[0]
    print(f"\n{a.tokens}-token tree, Llama demo shape with {a.layers} layers, float32, CPU (gloo), backend {a.backend}\n")
    print("| ranks | tokens per rank | target 1.15/ranks | saved for backward (max rank) | x single | model "
          "activations | x single | sdpa masks | log-prob rows | peak RSS delta (max rank) | x single | CPU s (max) |")
    print("|" + "---|" * 12)
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    for w, rs in rows.items():
        mx = {k: max(r[k] for r in rs) for k in rs[0]}
        rel = lambda k: f"{mx[k] / base[k]:.3f}" if base else "-"  # noqa: E731
        print(f"| {w} | {rs[0]['local_tokens']} | {1.15 / w:.3f} | {mib(mx['saved_bytes'])} | {rel('saved_bytes')} | "
              f"{mib(mx['saved_model'])} | {rel('saved_model')} | {mib(mx['saved_mask'])} | {mib(mx['saved_logprob'])} | "
              f"{mib(mx['peak_rss_delta'])} | {rel('peak_rss_delta')} | {mx['cpu_s']:.1f} |")
    if a.out:
        write_json({"tokens": a.tokens, "layers": a.layers, "backend": a.backend, "ranks": rows}, a.out)


if __name__ == "__main__":
    main()
