"""The compile budget: dynamo graphs built by compiled flex over a realistic GRPO loop.

    python benchmarks/compile_budget.py                         # 100 steps, rows of 300-6,000 tokens
    python benchmarks/compile_budget.py --steps 20 --scale 0.25 # quicker: rows of 75-1,500 tokens
    python benchmarks/compile_budget.py --out benchmarks/results/compile-budget.json

Runs on CPU with the CUDA compile configuration (automatic dynamic shapes, lengths marked dynamic up
front) and torch.compile backend ``aot_eager``, so that the backward runs on CPU too (FlexAttention's
CPU inductor kernel has no backward). Graph capture and guards -- what decides how many graphs are
built -- are dynamo's and the same for every backend; only code generation differs.

Each step draws one GRPO group (prompt + G responses, G in 2..8, row length uniform in
[min-len, max-len]) and runs a Gemma-2-style model (sliding-window and full layers alternating,
attention-logit softcap) patched with ``backend="flex"`` three times: the old policy and the reference
model under ``no_grad`` in eval mode, then the policy with grad in train mode and a backward. The loop
runs twice, in float32 and under bf16 autocast, in one process. Printed and saved: graphs per kernel
key (dtype, grad mode, autocast, pattern, score_mod) after each configuration, the step at which
each key built its last graph, and whether the sdpa fallback was ever needed (it must not be).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's flexgroup
import flexgroup  # noqa: E402
from flexgroup import GroupedBatch  # noqa: E402
from flexgroup.bench.measure import environment, write_json  # noqa: E402
from flexgroup.kernels import flex  # noqa: E402
from flexgroup.models.zoo import build_model  # noqa: E402


def gemma2_style(window: int, seed: int = 0) -> torch.nn.Module:
    """A small Gemma 2 (2 layers: sliding ``window``, then full; softcap 2.0; 4/2 heads of 16)."""
    return build_model("gemma2", seed=seed, sliding_window=window, max_position_embeddings=16384)


def draw_group(rng: random.Random, lo: int, hi: int, vocab: int) -> GroupedBatch:
    """One GRPO group whose packed row has between ``lo`` and ``hi`` tokens."""
    total = rng.randint(lo, hi)
    G = rng.randint(2, 8)
    prompt_len = max(1, int(total * rng.uniform(0.3, 0.9)))
    rest = max(G, total - prompt_len)
    cuts = sorted(rng.sample(range(1, rest), G - 1)) if rest > G else list(range(1, G))
    lens = [b - a for a, b in zip([0] + cuts, cuts + [rest])]
    g = torch.Generator().manual_seed(rng.randint(0, 2**31))
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g)  # noqa: E731
    return GroupedBatch.from_groups([ids(prompt_len)], [[ids(n) for n in lens]])


def run(steps: int, lo: int, hi: int, window: int, seed: int, log) -> dict:
    policy = flexgroup.patch(gemma2_style(window, seed), backend="flex")
    old = flexgroup.patch(copy.deepcopy(policy), backend="flex")
    ref = flexgroup.patch(gemma2_style(window, seed + 1), backend="flex")
    vocab = policy.config.vocab_size
    out = {"configurations": {}, "fallback": None}
    for name, ctx in (("float32", contextlib.nullcontext), ("bf16 autocast",
                                                          lambda: torch.autocast("cpu", dtype=torch.bfloat16))):
        rng = random.Random(seed)
        last_growth: dict[str, int] = {}
        per_step, lengths, times = [], [], []
        prev = {_name(k): n for k, n in flex.compiled_graphs().items()}  # what earlier configurations built
        for step in range(steps):
            batch = draw_group(rng, lo, hi, vocab)
            inputs = batch.model_inputs()
            t0 = time.process_time()
            with ctx():
                with torch.no_grad():
                    old.eval()(**inputs)
                    ref.eval()(**inputs)
                policy.train()
                lp = batch.logprobs(policy(**inputs).logits.float())
                (-torch.where(batch.response_mask, lp, 0).sum()).backward()
            policy.zero_grad(set_to_none=True)
            times.append(time.process_time() - t0)
            lengths.append(batch.num_tokens)
            graphs = flex.compiled_graphs()
            now = {_name(k): n for k, n in graphs.items()}
            last_growth.update({k: step + 1 for k, n in now.items() if n != prev.get(k, 0)})
            per_step.append(now)
            prev = now
            if step % 10 == 0 or step == steps - 1:
                log(f"{name} step {step + 1}/{steps}: L={batch.num_tokens}, {sum(graphs.values())} flex graphs "
                    f"in all, {times[-1]:.1f} s CPU")
        final = per_step[-1]
        out["configurations"][name] = {
            "graphs_per_key_cumulative": final, "last_growth_step": last_growth,
            "total_graphs_cumulative": sum(final.values()), "lengths": lengths, "cpu_s": times,
            "graphs_after_10_steps": sum(per_step[min(9, steps - 1)].values()),
        }
    out["fallback"] = flex._FALLBACK.get("why")
    return out


def _name(key: tuple) -> str:
    dev, dtype, grad, autocast, pattern, smod, gqa = key
    return (f"{str(dtype).replace('torch.', '')}, {'grad' if grad else 'no_grad'}"
            f"{', autocast' if autocast else ''}, pattern={pattern}, score_mod={smod}, gqa={gqa}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--min-len", type=int, default=300)
    ap.add_argument("--max-len", type=int, default=6000)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply lengths and the window (default 1)")
    ap.add_argument("--window", type=int, default=512, help="sliding window before --scale (default 512)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    log = lambda s: print(s, flush=True)  # noqa: E731
    lo, hi, w = (max(1, int(x * args.scale)) for x in (args.min_len, args.max_len, args.window))
    torch._dynamo.reset()
    t0 = time.perf_counter()
    with flex.cuda_profile_on_cpu():
        res = run(args.steps, lo, hi, w, args.seed, log)
    res.update(env=environment("cpu"), steps=args.steps, lengths=[lo, hi], window=w,
               recompile_limit=torch._dynamo.config.recompile_limit, wall_s=time.perf_counter() - t0)
    for name, c in res["configurations"].items():
        log(f"\n{name}: {c['total_graphs_cumulative']} flex graphs in all after both configurations so far")
        for k, n in c["graphs_per_key_cumulative"].items():
            log(f"  {n} graph(s), last new one at step {c['last_growth_step'].get(k)}: {k}")
    log(f"sdpa fallback: {res['fallback'] or 'never'}; wall {res['wall_s']:.0f} s")
    if args.out:
        write_json(res, args.out)
    worst = max((n for c in res["configurations"].values() for n in c["graphs_per_key_cumulative"].values()), default=0)
    return 0 if res["fallback"] is None and worst <= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
