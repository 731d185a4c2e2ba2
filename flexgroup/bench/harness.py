"""The harness of ``flexgroup bench``: time flexgroup against the repeated-prefix baseline and PrefixGrouper.

For each grid point (prefix:response ratio, G) it builds one group (prefix ``P = ratio * R``,
G responses of ``R`` tokens), checks every contender's log-probs against the baseline (a point whose
numbers disagree is reported as an error and not timed), then times one forward+backward of the
policy log-prob pass (``--level model``) or of attention alone (``--level attention``). It records
the median time, the activation memory (bytes saved for backward on CPU, ``max_memory_allocated``
on CUDA), tokens, attention pairs and the ideal speedup from ``Layout.cost()``, writes JSON and,
when matplotlib is installed (extra ``plot``), a plot of speedup versus prefix:response ratio, one
line per G, measured (solid) and ideal (dashed).

The CLI calls :func:`add_arguments` and :func:`run`; :func:`main` runs it standalone.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable, Sequence

import torch

from ..layout import Layout
from .measure import cuda_peak, environment, interleaved_medians, saved_bytes, write_json

__all__ = ["GRIDS", "MODELS", "point_record", "format_point", "build_model", "run_model_point", "run_attention_point",
           "prepare_model_contender", "prepare_attention_contender", "attention_inputs", "run_grid", "plot_results",
           "add_arguments", "run", "main"]

# the names the command line needs live in the torch-free options module (``flexgroup bench --help`` at once)
from .options import (ATTN_DEFAULT, DESCRIPTION, GRIDS, MODEL_DEFAULT, MODELS, RATIOS, WORKLOADS,  # noqa: E402,F401
                      add_arguments)


# ---------------------------------------------------------------------------------- a point's record
def point_record(lay: Layout, cfg_like, P: int, R: int, G: int) -> dict:
    """A grid point's record before timing: its sizes, tokens and attention pairs (baseline and grouped, from
    ``lay.cost()``) and the ideal speedup with ``cfg_like``'s FLOPs per token and pair."""
    from ..models.zoo import flops_per_token_and_pair

    c = lay.cost()
    return dict(prefix=P, response=R, G=G, ratio=P / R,
                tokens=dict(baseline=c.baseline_tokens, grouped=c.grouped_tokens),
                pairs=dict(baseline=c.baseline_pairs, grouped=c.grouped_pairs),
                ideal=c.ideal_speedup(*flops_per_token_and_pair(cfg_like)))


def _finish(rec: dict) -> dict:
    """Add speedups over the baseline: ``speedup`` (wall time) and, on CPU, ``speedup_cpu`` (process CPU time)."""
    res = rec["results"]
    for key, skey in (("median_s", "speedup"), ("median_cpu_s", "speedup_cpu")):
        base = res.get("baseline", {}).get(key)
        rec[skey] = {n: base / r[key] for n, r in res.items() if base and r.get(key)}
        rec[skey + "_over_ideal"] = {n: v / rec["ideal"] for n, v in rec[skey].items()}
    return rec


# ---------------------------------------------------------------------------------- model level
def build_model(model: str | dict, dtype=torch.float32, device="cpu", seed: int = 0):
    """A random-weight Llama from ``MODELS[model]`` (or a dict of ``llama_config`` kwargs)."""
    from ..models import zoo
    from .contenders import llama_config

    spec = MODELS[model] if isinstance(model, str) else model
    return zoo.build_model(llama_config(**spec), dtype, seed, attn_implementation="sdpa").to(device).train()


def prepare_model_contender(name: str, model, prompt, responses, ref: torch.Tensor | None = None,
                            atol: float = 1e-3) -> tuple[object, dict, torch.Tensor]:
    """Build contender ``name`` on a copy of ``model``, check it, measure memory.

    Returns ``(contender, info, logprobs)``; ``info`` holds ``max_abs_err`` against ``ref`` (the
    baseline's log-probs [G, max_R]; the contender's own when ``ref`` is None), ``saved_bytes``
    and on CUDA ``peak_bytes``. Raises AssertionError when the log-probs differ by more than ``atol``.
    """
    from .contenders import MODEL_CONTENDERS

    device = next(model.parameters()).device
    c = MODEL_CONTENDERS[name](model, prompt, responses)
    lp = c.logprobs().detach()  # with autograd on: the same code path as the timed step
    err = 0.0 if ref is None else (lp - ref).abs().max().item()
    info = {"max_abs_err": err}
    if not err <= atol:
        raise AssertionError(f"{name}: log-probs differ from the baseline by {err:.3g} > {atol}")
    if device.type == "cuda":
        info["peak_bytes"] = cuda_peak(c.step, device)
    info["saved_bytes"] = saved_bytes(c.forward_loss, list(c.model.parameters()))
    return c, info, lp


def run_model_point(model, P: int, R: int, G: int, contenders: Sequence[str] = MODEL_DEFAULT,
                    repeats: int = 3, warmup: int = 1, atol: float = 1e-3, seed: int = 0) -> dict:
    """One forward+backward of the log-prob pass per contender; returns the point's record.

    ``model`` is a stock (unpatched) Hugging Face causal LM; every contender works on a deep copy.
    Every contender is checked against the baseline first; one that fails gets ``error`` and no time.
    """
    from .contenders import make_group

    device = next(model.parameters()).device
    prompt, responses = make_group(P, [R] * G, model.config.vocab_size, seed)
    rec = point_record(Layout.group(P, [R] * G), model.config, P, R, G)
    rec.update(level="model", results={})
    ref, objs, steps = None, {}, {}
    for name in dict.fromkeys(["baseline", *contenders]):
        try:
            objs[name], rec["results"][name], lp = prepare_model_contender(name, model, prompt, responses, ref, atol)
            ref = lp if ref is None else ref
            steps[name] = objs[name].step
        except Exception as e:  # noqa: BLE001 -- recorded, never a silent number
            rec["results"][name] = {"error": f"{type(e).__name__}: {e}"}
            if name == "baseline":
                return _finish(rec)
    return _time_and_finish(rec, steps, repeats, warmup, device)


def _time_and_finish(rec: dict, steps: dict, repeats: int, warmup: int, device) -> dict:
    """Time the checked contenders in interleaved rounds and record medians (wall and, on CPU, CPU time)."""
    for name, times in interleaved_medians(steps, repeats, warmup, device).items():
        rec["results"][name].update(times)
    return _finish(rec)


# ---------------------------------------------------------------------------------- attention level
def attention_inputs(P: int, R: int, G: int, mode: str = "fwdbwd", heads: int = 8, kv_heads: int = 4,
                     head_dim: int = 32, device="cpu", dtype=torch.float32, seed: int = 0):
    """(AttentionInputs, grad_out [G, heads, P+R, head_dim], record-with-metadata) for one point."""
    from types import SimpleNamespace

    from .contenders import AttentionInputs

    if mode not in ("fwd", "fwdbwd"):
        raise ValueError(f"mode={mode!r}: choose 'fwd' or 'fwdbwd'")
    lay = Layout.group(P, [R] * G)
    shape = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                            hidden_size=heads * head_dim, intermediate_size=0, num_hidden_layers=1)
    rec = point_record(lay, shape, P, R, G)
    rec["ideal"] = rec["pairs"]["baseline"] / rec["pairs"]["grouped"]  # attention alone: pair ratio
    rec.update(level="attention", mode=mode, results={})
    x = AttentionInputs(lay, heads, kv_heads, head_dim, dtype=dtype, device=device, seed=seed,
                        requires_grad=(mode == "fwdbwd"))
    g = torch.Generator().manual_seed(seed + 1)
    gout = torch.randn(G, heads, P + R, head_dim, generator=g).to(device=device, dtype=dtype)
    return x, gout, rec


def prepare_attention_contender(name: str, x, gout: torch.Tensor, mode: str = "fwdbwd",
                                ref: tuple | None = None, atol: float = 1e-4):
    """Check attention contender ``name`` against ``ref`` (outputs and q/k/v gradients along the paths).

    Returns ``(step, info, out)``: ``step()`` runs one timed call (forward, or forward+backward),
    ``out`` the tensors compared (pass the baseline's as ``ref`` for the others).
    """
    from .contenders import ATTENTION_CONTENDERS

    fn, to_paths, leaves = ATTENTION_CONTENDERS[name](x)
    if mode == "fwd":
        with torch.no_grad():
            out = (to_paths(fn()),)

        def step(fn=fn):
            with torch.no_grad():
                fn()
    else:
        o = to_paths(fn())
        grads = torch.autograd.grad(o, leaves, grad_outputs=gout)
        if leaves[0].shape[0] != 1:  # baseline: fold path grads back onto packed tokens
            grads = tuple(_fold(gr, x.paths, x.layout.num_tokens) for gr in grads)
        out = (o.detach(), *grads)

        def step(fn=fn, leaves=leaves):
            o = fn()
            torch.autograd.grad(o, leaves, grad_outputs=torch.ones_like(o))
    err = 0.0 if ref is None else max((a - b).abs().max().item() for a, b in zip(out, ref))
    info = {"max_abs_err": err}
    if not err <= atol:
        raise AssertionError(f"{name}: outputs/gradients differ from the baseline by {err:.3g} > {atol}")
    if mode == "fwdbwd":
        info["saved_bytes"] = saved_bytes(fn, leaves)
        if x.q.device.type == "cuda":
            info["peak_bytes"] = cuda_peak(step, x.q.device)
    return step, info, out


def run_attention_point(P: int, R: int, G: int, contenders: Sequence[str] = ATTN_DEFAULT,
                        mode: str = "fwdbwd", heads: int = 8, kv_heads: int = 4, head_dim: int = 32,
                        repeats: int = 3, warmup: int = 1, atol: float = 1e-4, device="cpu",
                        dtype=torch.float32, seed: int = 0) -> dict:
    """Attention alone (``mode`` "fwdbwd" or "fwd"): every contender checked, then timed interleaved."""
    x, gout, rec = attention_inputs(P, R, G, mode, heads, kv_heads, head_dim, device, dtype, seed)
    ref, steps = None, {}
    for name in dict.fromkeys(["baseline", *contenders]):
        try:
            steps[name], rec["results"][name], out = prepare_attention_contender(name, x, gout, mode, ref, atol)
            ref = out if ref is None else ref
        except Exception as e:  # noqa: BLE001
            rec["results"][name] = {"error": f"{type(e).__name__}: {e}"}
            if name == "baseline":
                return _finish(rec)
    return _time_and_finish(rec, steps, repeats, warmup, device)


def _fold(grad_paths: torch.Tensor, paths, L: int) -> torch.Tensor:
    """[G, H, n, D] gradients of per-path copies -> [1, H, L, D] summed onto the packed tokens."""
    out = grad_paths.new_zeros(grad_paths.shape[1], L, grad_paths.shape[3])
    for g, p in enumerate(paths):
        out.index_add_(1, p.to(out.device), grad_paths[g])
    return out[None]


# ---------------------------------------------------------------------------------- grid, output
def run_grid(level: str = "model", grid: str | dict = "quick", model: str | dict = "small",
             contenders: Sequence[str] | None = None, repeats: int = 3, warmup: int = 1,
             mode: str = "fwdbwd", device: str = "cpu", log: Callable[[str], None] = print) -> dict:
    """Run every (ratio, G) point of ``grid``; returns ``{"env", "config", "points"}``."""
    spec = GRIDS[grid] if isinstance(grid, str) else grid
    R = spec["response_len"]
    pts = [(max(1, round(r * R)), R, G) for G in spec["groups"] for r in spec["ratios"]]
    shape = MODELS[model] if isinstance(model, str) else dict(model)
    out = dict(env=environment(device), config=dict(level=level, grid=spec, model=model if isinstance(model, str)
                                                     else "custom", shape=shape,
                                                     repeats=repeats, warmup=warmup, mode=mode), points=[])
    if level == "model":
        contenders = list(contenders or MODEL_DEFAULT)
        m = build_model(shape, device=device)
    else:
        contenders = list(contenders or ATTN_DEFAULT)
    from .contenders import pg_available

    if "prefix-grouper" in contenders and not pg_available():
        log("prefix-grouper is not installed (pip install prefix-grouper): skipping that contender")
        contenders.remove("prefix-grouper")
    t_start = time.perf_counter()
    for i, (P, R_, G) in enumerate(pts, 1):
        if level == "model":
            rec = run_model_point(m, P, R_, G, contenders, repeats, warmup)
        else:
            rec = run_attention_point(P, R_, G, contenders, mode, shape["heads"], shape["kv_heads"],
                                      shape["hidden"] // shape["heads"], repeats, warmup, device=device)
        out["points"].append(rec)
        log(f"[{i}/{len(pts)} {time.perf_counter() - t_start:6.1f}s] " + format_point(rec))
    return out


RATIO_NOTE = (
    "ratios: each contender's speedup = the baseline's time / its time (wall; 'cpu' = process CPU time), where "
    "the baseline is the G sequences [P; R_i] as one right-padded batch through the stock model (sdpa). "
    "ideal = the exact decoder work of the G sequences alone over flexgroup's (tokens through every projection "
    "and MLP, and causal attention pairs: Layout.cost). A measured ratio can pass the ideal: the baseline also "
    "pays for padding, attention over masked-out padded pairs and per-sequence overhead that the ideal does not "
    "count, and wall time moves with the machine's load (CPU time is steadier)."
)


def format_point(rec: dict) -> str:
    parts = [f"P={rec['prefix']:<5} R={rec['response']:<4} G={rec['G']:<3} ideal {rec['ideal']:5.2f}x"]
    for n, r in rec["results"].items():
        if "error" in r:
            parts.append(f"{n}: ERROR {r['error'][:80]}")
        elif n != "baseline":
            cpu = rec.get("speedup_cpu", {}).get(n)
            parts.append(f"{n} {rec['speedup'][n]:5.2f}x" + (f" (cpu {cpu:4.2f}x)" if cpu else ""))
        else:
            parts.append(f"baseline {r['median_s'] * 1e3:8.1f} ms")
    return " | ".join(parts)


def plot_results(data: dict, path: str, contender: str = "flexgroup", metric: str | None = None) -> bool:
    """Speedup vs prefix:response ratio, one line per G (measured solid, ideal dashed). False if no matplotlib.

    ``metric``: "speedup" (wall time) or "speedup_cpu" (process CPU time); default: CPU time on CPU runs.
    """
    if metric is None:
        metric = "speedup_cpu" if data["env"]["device"] == "cpu" else "speedup"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = sorted({p["G"] for p in data["points"]})
    for k, G in enumerate(groups):
        pts = sorted((p for p in data["points"] if p["G"] == G), key=lambda p: p["ratio"])
        color = f"C{k}"
        xs = [p["ratio"] for p in pts]
        ax.plot(xs, [p["ideal"] for p in pts], "--", color=color, alpha=0.6, label=f"G={G} ideal")
        meas = [(p["ratio"], p[metric].get(contender, math.nan)) for p in pts]
        ax.plot([a for a, _ in meas], [b for _, b in meas], "o-", color=color, label=f"G={G} {contender}")
        if any("prefix-grouper" in p[metric] for p in pts):
            ax.plot(xs, [p[metric].get("prefix-grouper", math.nan) for p in pts], "x:", color=color,
                    alpha=0.8, label=f"G={G} prefix-grouper")
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("prefix : response length ratio")
    ax.set_ylabel("speedup over repeated-prefix baseline " + ("(CPU time)" if metric == "speedup_cpu" else "(time)"))
    cfg = data["config"]
    ax.set_title(f"{cfg['level']} level, {data['env']['device']}, model {cfg['model']}, "
                 f"{data['env']['torch_threads']} thread(s)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------- CLI
def run(args: argparse.Namespace) -> int:
    """Run ``flexgroup bench``; returns the exit status (1 if any contender errored)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    grid = "quick" if args.quick else args.grid
    repeats = args.repeats
    contenders = [c.strip() for c in args.contenders.split(",")] if args.contenders else None
    print(f"flexgroup bench: level={args.level} grid={grid} model={args.model} device={args.device} "
          f"threads={torch.get_num_threads()}", flush=True)
    print(RATIO_NOTE, flush=True)
    data = run_grid(args.level, grid, args.model, contenders, repeats, args.warmup, args.mode, args.device,
                    log=lambda s: print(s, flush=True))
    write_json(data, args.out + ".json")
    print(f"wrote {args.out}.json")
    if plot_results(data, args.out + ".png"):
        print(f"wrote {args.out}.png")
    else:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    above = [(p["G"], p["ratio"]) for p in data["points"] if p.get("speedup", {}).get("flexgroup", 0) > p["ideal"]]
    if above:
        print(f"{len(above)} of {len(data['points'])} points measured above the ideal (wall time): (G, P:R) = "
              f"{above}; the ideal counts decoder work only (see the note at the top)")
    errors = [(p["G"], p["ratio"], n) for p in data["points"] for n, r in p["results"].items() if "error" in r]
    if errors:
        print(f"{len(errors)} contender runs failed (see 'error' in the JSON): {errors[:5]}")
    return 1 if errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``flexgroup bench [WORKLOAD] ...`` (:func:`flexgroup.bench.options.main`: parse, then run)."""
    from .options import main as _main

    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
