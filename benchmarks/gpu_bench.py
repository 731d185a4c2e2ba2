"""GPU benchmark (issue 6): one command, correctness check first, then a table in ./gpu_bench-results/.

    python benchmarks/gpu_bench.py              # H200-class GPU, a few minutes
    python benchmarks/gpu_bench.py --toy        # CPU, toy sizes (keeps the script from rotting; ~2 min)
    python benchmarks/gpu_bench.py --out benchmarks/results   # record a run in the repository's results

Model: Qwen3-4B's shape (hidden 2560, 32 query / 8 KV heads of 128, MLP 9728, vocab 151936, tied
embeddings) with random bf16 weights and ``--layers`` decoder layers (default 4: the baseline's
activations at G=8, prefix 8192 do not fit 36 layers without checkpointing; every ratio here is per
layer, so it carries over). G=8, prefix 4096 and 8192, responses 256 and 512.

Contenders, one forward+backward of the policy log-prob pass each (see flexgroup/bench/contenders.py):
baseline (stock model, sdpa, padded batch, completion logits only), flexgroup (patched, backend
"auto" = compiled flex on CUDA), the PrefixGrouper algorithm (PyPI ``prefix-grouper`` through the
exact SDPA adapter). Reported: median time, ``torch.cuda.max_memory_allocated`` above the resident
weights, achieved TFLOP/s from the exact FLOP count of what each contender computes, effective
TFLOP/s (the baseline's FLOPs / time), speedup and the ideal ratio.

Attention alone: grouped flex (the group's layout) versus dense causal flex at the same total length,
forward and forward+backward, in useful TFLOP/s (4 * Hq * D FLOPs per allowed pair forward, 2.5x that
backward).

Correctness first: a float32 2-layer copy of the shape at a small size must match the baseline
(log-probs and parameter gradients); otherwise the script stops before timing anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

from flexgroup import Layout, attention
from flexgroup.bench import environment, prepare_model_contender, time_interleaved
from flexgroup.bench.contenders import make_group, model_flops, pg_available, qwen3_4b_config


def toy_config(layers: int = 2):
    from transformers import Qwen3Config

    # head_dim 32: compiled flex_attention on CPU (torch 2.13) is wrong for head_dim < 32 at some lengths
    return Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=256, tie_word_embeddings=True,
                       max_position_embeddings=4096, attention_dropout=0.0)


def build(cfg, dtype, device, seed=0):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        m = Qwen3ForCausalLM(cfg)
    return m.to(dtype).train()


def check_correctness(cfg, device, contenders, P, R, G, log) -> dict:
    """float32: every contender's log-probs and parameter gradients against the baseline's. Raises on mismatch."""
    m = build(cfg, torch.float32, device)
    prompt, responses = make_group(P, [R] * G, cfg.vocab_size, seed=1)
    objs, out = {}, {}
    for name in ["baseline", *contenders]:
        c, info, _ = prepare_model_contender(name, m, prompt, responses,
                                             None if name == "baseline" else out["baseline"]["lp"], atol=2e-3)
        c.step()
        grads = {k: p.grad.float() for k, p in c.model.named_parameters() if p.grad is not None}
        out[name] = {"lp": c.logprobs().detach(), "grads": grads, "lp_err": info["max_abs_err"]}
        objs[name] = c
    res = {}
    for name in contenders:
        gb, gc = out["baseline"]["grads"], out[name]["grads"]
        if set(gb) != set(gc):
            raise AssertionError(f"{name}: parameters with gradients differ from the baseline's")
        rel = max(((gb[k] - gc[k]).norm() / gb[k].norm().clamp_min(1e-30)).item() for k in gb)
        res[name] = {"logprob_max_abs_err": out[name]["lp_err"], "grad_max_rel_err": rel}
        log(f"  check {name}: log-prob max |err| {out[name]['lp_err']:.2e}, gradient max rel err {rel:.2e}")
        if not rel <= 1e-2:
            raise AssertionError(f"{name}: parameter gradients differ from the baseline (rel {rel:.3g} > 1e-2)")
    return res


def model_point(m, cfg, P, R, G, contenders, repeats, warmup, device, log) -> dict:
    prompt, responses = make_group(P, [R] * G, cfg.vocab_size)
    lay = Layout.group(P, [R] * G)
    cost = lay.cost()
    from flexgroup.models import flops_per_token_and_pair

    ideal = cost.ideal_speedup(*flops_per_token_and_pair(cfg))
    base_flops = model_flops(cfg, cost.baseline_tokens, cost.baseline_pairs, G * (R + 1))
    grp_flops = model_flops(cfg, cost.grouped_tokens, cost.grouped_pairs, G * R)
    rec = dict(prefix=P, response=R, G=G, ideal=ideal, tokens=dict(baseline=cost.baseline_tokens,
               grouped=cost.grouped_tokens), pairs=dict(baseline=cost.baseline_pairs, grouped=cost.grouped_pairs),
               flops=dict(baseline=base_flops, grouped=grp_flops), results={})
    objs, steps, ref = {}, {}, None
    for name in ["baseline", *contenders]:
        try:
            objs[name], info, lp = prepare_model_contender(name, m, prompt, responses, ref, atol=math.inf)
            if ref is None:
                ref = lp
            info["bf16_logprob_max_abs_err"] = info.pop("max_abs_err")
            info["bf16_logprob_mean_abs_err"] = (lp - ref).abs().sum().item() / ref.numel()
            rec["results"][name] = info
            steps[name] = objs[name].step
        except torch.cuda.OutOfMemoryError as e:
            rec["results"][name] = {"error": f"out of memory: {str(e)[:120]}"}
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 -- recorded in the table
            rec["results"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    timed = time_interleaved(steps, repeats, warmup, device)
    base_t = statistics.median(timed["baseline"]) if "baseline" in timed else None
    for name, ts in timed.items():
        r = rec["results"][name]
        t = statistics.median(ts)
        fl = base_flops if name == "baseline" else grp_flops
        r.update(median_s=t, times_s=ts, tflops=fl / t / 1e12, effective_tflops=base_flops / t / 1e12)
        if base_t:
            r["speedup"] = base_t / t
            r["speedup_over_ideal"] = r["speedup"] / ideal
    key = "peak_bytes" if torch.device(device).type == "cuda" else "saved_bytes"
    base_mem = rec["results"].get("baseline", {}).get(key)
    for name, r in rec["results"].items():
        if base_mem and key in r:
            r["memory_vs_baseline"] = r[key] / base_mem  # peak on CUDA, saved-for-backward elsewhere
    del objs, steps
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return rec


def attention_point(cfg, P, R, G, dtype, device, repeats, warmup, train: bool) -> dict:
    """Grouped flex vs dense causal flex at the same total length; useful TFLOP/s."""
    lay = Layout.group(P, [R] * G)
    L = lay.num_tokens
    dense = Layout.tree([-1], [L])  # one causal segment of the same length
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(0)
    mk = lambda h: torch.randn(1, h, L, d, generator=g).to(device=device, dtype=dtype).requires_grad_(train)  # noqa: E731
    q, k, v = mk(hq), mk(hkv), mk(hkv)
    per_pair = 4 * hq * d * (3.5 if train else 1.0)
    rec = dict(prefix=P, response=R, G=G, L=L, mode="fwd+bwd" if train else "fwd", results={})
    steps = {}
    for name, lay_ in (("grouped flex", lay), ("dense causal flex", dense)):
        pairs = lay_.cost().grouped_pairs

        def step(lay_=lay_):
            with torch.set_grad_enabled(train):
                o = attention(q, k, v, lay_, backend="flex")
                if train:
                    torch.autograd.grad(o, (q, k, v), grad_outputs=torch.ones_like(o))

        steps[name] = step
        rec["results"][name] = {"pairs": pairs}
    for name, ts in time_interleaved(steps, repeats, warmup, device).items():
        r = rec["results"][name]
        r.update(median_s=statistics.median(ts), tflops=r["pairs"] * per_pair / statistics.median(ts) / 1e12)
    rg, rd = rec["results"]["grouped flex"], rec["results"]["dense causal flex"]
    rec["throughput_ratio"] = rg["tflops"] / rd["tflops"]
    return rec


def to_markdown(data: dict) -> str:
    env = data["env"]
    lines = [f"# flexgroup GPU benchmark{' (toy, CPU)' if data['toy'] else ''}", "",
             f"- date: {env['date']}", f"- device: {env.get('gpu') or env.get('cpu')} ({env['device']})",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
             f"- model: {data['model']}", f"- dtype: {data['dtype']}, repeats {data['repeats']} (median)", "",
             "## Correctness (float32, small size)", "", "| contender | log-prob max abs err | grad max rel err |",
             "|---|---|---|"]
    for n, r in data["check"].items():
        lines.append(f"| {n} | {r['logprob_max_abs_err']:.2e} | {r['grad_max_rel_err']:.2e} |")
    lines += ["", "## Forward+backward of the log-prob pass", "",
              "| P | R | G | ideal | contender | time ms | speedup | of ideal | peak GiB | saved-for-bwd GiB | mem vs base "
              "| TFLOP/s | eff. TFLOP/s | lp err vs base (mean) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in data["model_points"]:
        for n, r in p["results"].items():
            if "error" in r:
                lines.append(f"| {p['prefix']} | {p['response']} | {p['G']} | {p['ideal']:.2f} | {n} | {r['error']} |"
                             + " |" * 9)
                continue
            pk = r.get("peak_bytes")
            lines.append(
                f"| {p['prefix']} | {p['response']} | {p['G']} | {p['ideal']:.2f} | {n} | {r['median_s'] * 1e3:.1f} | "
                + ("– | – | " if n == "baseline" else
                   f"{r.get('speedup', float('nan')):.2f}x | {r.get('speedup_over_ideal', float('nan')):.2f} | ") +
                f"{pk / 2**30 if pk else float('nan'):.2f} | {r['saved_bytes'] / 2**30:.3f} | "
                f"{r.get('memory_vs_baseline', float('nan')):.2f} | "
                f"{r['tflops']:.3g} | {r['effective_tflops']:.3g} | {r['bf16_logprob_mean_abs_err']:.2e} |")
    lines += ["", "mem vs base: peak (max_memory_allocated above the resident weights) on CUDA, bytes saved "
              "for backward elsewhere. lp err: mean |log-prob - baseline's| in the benchmark dtype.", "",
              "## Attention alone: grouped flex vs dense causal flex, same total length", "",
              "| P | R | G | L | mode | grouped ms | grouped useful TFLOP/s | dense ms | dense TFLOP/s | grouped/dense throughput |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for p in data["attention_points"]:
        g, d = p["results"]["grouped flex"], p["results"]["dense causal flex"]
        lines.append(f"| {p['prefix']} | {p['response']} | {p['G']} | {p['L']} | {p['mode']} | {g['median_s'] * 1e3:.2f} | "
                     f"{g['tflops']:.3g} | {d['median_s'] * 1e3:.2f} | {d['tflops']:.3g} | {p['throughput_ratio']:.2f} |")
    lines += ["", "Targets (issue 6): speedup >= 0.9 of ideal; >= 1.3x the PrefixGrouper algorithm; peak memory "
              "<= 0.35 of the baseline's; grouped flex >= 80% of dense causal flex useful-FLOP throughput.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toy", action="store_true", help="CPU, toy sizes")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default="gpu_bench-results",
                    help="output folder (default ./gpu_bench-results; the tracked results are in benchmarks/results)")
    args = ap.parse_args(argv)
    log = lambda s: print(s, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    if args.toy:
        device, dtype, cfg = "cpu", torch.float32, toy_config(args.layers if args.layers != 4 else 2)
        points, G, check_size = [(64, 16), (128, 16)], 4, (32, 8, 3)
        check_cfg = toy_config(2)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --toy on CPU", file=sys.stderr)
            return 2
        device, dtype, cfg = "cuda", torch.bfloat16, qwen3_4b_config(args.layers)
        points, G, check_size = [(4096, 256), (4096, 512), (8192, 256), (8192, 512)], 8, (512, 64, 4)
        check_cfg = qwen3_4b_config(2)
    contenders = ["flexgroup"] + (["prefix-grouper"] if pg_available() else [])
    if "prefix-grouper" not in contenders:
        log("prefix-grouper is not installed (pip install prefix-grouper): that contender is skipped")
    env = environment(device)
    log(f"gpu_bench: {env.get('gpu') or env.get('cpu')}, torch {env['versions']['torch']}, layers {cfg.num_hidden_layers}")
    log("correctness check (float32, 2 layers, P=%d R=%d G=%d)" % check_size)
    check = check_correctness(check_cfg, device, contenders, *check_size, log)
    if device == "cuda":
        torch.cuda.empty_cache()
    m = build(cfg, dtype, device)
    model_points = []
    for P, R in points:
        rec = model_point(m, cfg, P, R, G, contenders, args.repeats, args.warmup, device, log)
        model_points.append(rec)
        log(f"[{time.perf_counter() - t_start:6.0f}s] P={P} R={R} G={G} ideal {rec['ideal']:.2f}x | " + " | ".join(
            f"{n} {r['median_s'] * 1e3:.0f} ms {r.get('speedup', 0):.2f}x" if "median_s" in r else f"{n} {r.get('error')}"
            for n, r in rec["results"].items()))
    del m
    attention_points = []
    for P, R in points:
        for train in ([False, True] if device == "cuda" else [False]):  # no flex backward on CPU
            rec = attention_point(cfg, P, R, G, dtype, device, args.repeats, args.warmup, train)
            attention_points.append(rec)
            log(f"[{time.perf_counter() - t_start:6.0f}s] attention {rec['mode']} P={P} R={R}: grouped/dense "
                f"throughput {rec['throughput_ratio']:.2f}")
    data = dict(env=env, toy=args.toy, dtype=str(dtype), repeats=args.repeats,
                model=f"Qwen3-4B shape, {cfg.num_hidden_layers} layers" if not args.toy else "toy Qwen3 (hidden 128, head_dim 32)",
                check=check, model_points=model_points, attention_points=attention_points,
                wall_s=time.perf_counter() - t_start)
    os.makedirs(args.out, exist_ok=True)
    tag = "toy-cpu" if args.toy else (env.get("gpu", "gpu").replace(" ", "_") + "-" + env["date"][:10])
    stem = os.path.join(args.out, f"gpu_bench-{tag}")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(to_markdown(data))
    log(f"wrote {stem}.md and .json ({data['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
