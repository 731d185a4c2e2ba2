"""Compile behaviour of the compiled flex path: 20 steps of varying lengths (random prefix and
response lengths, G=4) through ``flexgroup.attention(backend="flex")`` -- forward on CPU
(FlexAttention has no CPU backward), forward+backward on CUDA. Reports how many graphs
torch.compile built (goal: at most 2 in total) and the first-call (compile) time.

Two variants: ``shipped`` is ``flexgroup.attention`` as it is (on CPU it compiles static, one graph
per distinct length, by design -- see ``compiled_flex_attention``); ``dynamic`` is the CUDA
configuration (``torch.compile(flex_attention)``, automatic dynamic shapes) with flexgroup's block
masks, so the recompile behaviour of the GPU path can be seen on a CPU-only machine.

Dynamo is reset first so the count starts from zero; Inductor's on-disk cache may still shorten the
compile time of a second run (``inductor`` counters in extra_info show cache hits).

    pytest benchmarks/test_compile.py --benchmark-only
"""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from torch.nn.attention.flex_attention import flex_attention

from flexgroup import Layout, attention
from flexgroup.layout import masks

STEPS = 20


def shipped(q, k, v, lay):
    return attention(q, k, v, lay, backend="flex")


def make_dynamic():
    fn = torch.compile(flex_attention)  # dynamic=None: automatic dynamic shapes, as on CUDA

    def dynamic(q, k, v, lay):
        return fn(q, k, v, block_mask=masks.block_mask(lay, device=q.device), enable_gqa=q.shape[1] != k.shape[1])

    return dynamic


def run_steps(device: str = "cpu", attn=shipped, seed: int = 0, heads: int = 4, kv_heads: int = 2,
              head_dim: int = 32) -> dict:
    """20 varying-length steps from a fresh dynamo state; returns counts and per-step times."""
    torch._dynamo.reset()
    if attn is shipped:  # drop the process-wide compiled callable too, so the count starts cold
        import sys

        getattr(sys.modules["flexgroup.attention"], "_COMPILED_FLEX", {}).clear()
    counters.clear()
    rng = random.Random(seed)
    train = torch.device(device).type == "cuda"
    times, lengths = [], []
    for _ in range(STEPS):
        lay = Layout.group(rng.randint(64, 640), [rng.randint(8, 128) for _ in range(4)])
        L = lay.num_tokens
        q = torch.randn(1, heads, L, head_dim, device=device, requires_grad=train)
        k = torch.randn(1, kv_heads, L, head_dim, device=device, requires_grad=train)
        v = torch.randn(1, kv_heads, L, head_dim, device=device, requires_grad=train)
        t0 = time.perf_counter()
        with torch.set_grad_enabled(train):
            out = attn(q, k, v, lay)
            if train:
                out.sum().backward()
        if train:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        lengths.append(L)
    # compiles: frames dynamo compiled (past the recompile limit it stops compiling and runs eager flex)
    return dict(compiles=counters["frames"]["ok"], graphs_captured=counters["stats"]["unique_graphs"],
                recompiles=sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
                inductor={k: v for k, v in counters["inductor"].items() if "cache" in k},
                first_call_s=times[0], times_s=times, lengths=lengths,
                steady_median_s=sorted(times[2:])[len(times[2:]) // 2])


@pytest.mark.parametrize("variant", ["shipped", "dynamic"])
def test_compile_20_steps(benchmark, variant):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = {}
    benchmark.group = "compile behaviour"
    attn = shipped if variant == "shipped" else make_dynamic()
    benchmark.pedantic(lambda: res.update(run_steps(device, attn)), rounds=1, iterations=1)
    benchmark.extra_info.update(res, variant=variant, device=device, goal_max_compiles=2,
                                threads=torch.get_num_threads())
    print(f"\n{variant}: compiles={res['compiles']} first_call={res['first_call_s']:.1f}s "
          f"steady median={res['steady_median_s'] * 1e3:.1f} ms lengths={res['lengths']}")
