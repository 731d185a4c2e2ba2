"""Issue 43's side measurements: where the model's own matmuls are not batch-invariant, what per-tree
weight gradients would cost, and the lse backend on rows of many groups (docs/batch-invariance.md).

    python benchmarks/batch_invariance.py [--threads 1]
    PYTHONPATH=<a flexgroup tree> python benchmarks/batch_invariance.py --pack   # 4., for that tree's code

1. Linear rows: for float32 and bfloat16 weights of the shapes below, the row counts ``m`` at which
   ``linear(x[o:o + m], w)`` is not bitwise ``linear(x, w)[o:o + m]`` (700 rows, offsets 0, 1, 5, 100).
2. Weight gradient of one tree, alone vs after another tree's zero-gradient rows (one GEMM each).
3. Weight-gradient GEMM of a 256 -> 1024 layer over 8,192 tokens: one GEMM vs one per tree accumulated
   in tree order (process CPU time, median of 5).
4. ``--pack`` only: ``flexgroup.attention(..., backend="lse")`` forward+backward on rows of many groups
   (8 query / 4 KV heads of 64), process CPU time, median of 5, as JSON.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(64, 128), (256, 1024), (1024, 256), (256, 2048), (896, 4864)]
ROWS = list(range(1, 20)) + [31, 63, 64, 65, 127, 128, 129, 300, 511]


def linear_rows(dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for k, n in SHAPES:
        w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(700, k, generator=g).to(dtype)
        ref = torch.nn.functional.linear(x, w)
        out[f"{k}x{n}"] = sorted({m for m in ROWS for o in (0, 1, 5, 100)
                                  if not torch.equal(torch.nn.functional.linear(x[o:o + m], w), ref[o:o + m])})
    return out


def _cpu_median(f, n: int = 5) -> float:
    f()
    ts = []
    for _ in range(n):
        t = time.process_time()
        f()
        ts.append(time.process_time() - t)
    return sorted(ts)[n // 2]


def pack_times() -> dict:
    import flexgroup
    from flexgroup import Layout

    out = {"flexgroup": flexgroup.__file__}
    for groups, P, R, G in ((16, 128, 32, 8), (64, 64, 16, 4), (4, 1024, 128, 8)):
        lay = Layout.pack([Layout.group(P, [R + (i * 7 + j * 3) % 9 for j in range(G)]) for i in range(groups)])
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, lay.num_tokens, 64, generator=g).requires_grad_() for h in (8, 4, 4))

        def step():
            flexgroup.attention(q, k, v, lay, backend="lse").sum().backward()

        out[f"{groups} groups, P={P}, G={G}, R~{R}"] = _cpu_median(step)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pack", action="store_true", help="only 4.: the lse backend on rows of many groups")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.pack:
        import json

        print(json.dumps(pack_times()))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    for dt in (torch.float32, torch.bfloat16):
        print(f"linear rows not invariant, {dt}: {linear_rows(dt)}")
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        xa, ga = torch.randn(2048, 256, generator=g).to(dt), torch.randn(2048, 1024, generator=g).to(dt)
        xb = torch.randn(1500, 256, generator=g).to(dt)
        alone = ga.T @ xa
        packed = torch.cat([torch.zeros(1500, 1024, dtype=dt), ga]).T @ torch.cat([xb, xa])
        print(f"dW of a tree alone vs after zero-gradient rows, {dt}: equal {torch.equal(alone, packed)}, "
              f"max |diff| {(alone.float() - packed.float()).abs().max().item():.3g}")
    for trees, n in ((4, 2048), (32, 256), (128, 64)):
        x, gr = torch.randn(trees * n, 256, generator=g), torch.randn(trees * n, 1024, generator=g)

        def per_tree():
            acc = torch.zeros(1024, 256)
            for i in range(trees):
                acc += gr[i * n:(i + 1) * n].T @ x[i * n:(i + 1) * n]
            return acc

        one = _cpu_median(lambda: gr.T @ x)
        print(f"weight grad 256->1024, {trees} trees x {n} tokens, float32: one GEMM {one * 1e3:.1f} ms, "
              f"per tree {_cpu_median(per_tree) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
