"""Markdown tables from the benchmark JSON files in benchmarks/results/ (used for benchmarks/README.md).

    python benchmarks/summarize.py benchmarks/results/*.json [--metric speedup|speedup_cpu]

Reads every kind this folder writes: ``flexgroup bench`` grids (``env``/``config``/``points``), single
points or lists of points (the same records without the run header), pytest-benchmark files
(``--benchmark-json``: ``machine_info``/``benchmarks``), ``gpu_bench.py`` results (``model_points``),
workload records (``flexgroup bench trees|hybrids|scoring|stream``: ``results`` per contender beside an
``ideal``, or several of them under ``workloads``), and, for any other JSON, a flat table of its scalar
values. Every ratio is against the contender whose ``speedup`` is 1.0 (the table says which).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def table(points: list[dict], metric: str) -> str:
    """One row per (G, prefix:response ratio) point: ideal, baseline time, each contender's speedup."""
    contenders = [n for n in points[0]["results"] if n != "baseline"]
    note = ("speedups against `baseline`: the G sequences [P; R_i] as one right-padded batch through the stock "
            "model; the ideal counts the work of each sequence alone (no padding), so where responses differ in "
            "length the baseline's padding work can lift a measured speedup above the ideal\n\n")
    head = note + "| G | P:R | P | ideal | baseline ms | " + " | ".join(f"{c} (of ideal)" for c in contenders) + " |"
    lines = [head, "|" + "---|" * (5 + len(contenders))]
    for p in sorted(points, key=lambda p: (p["G"], p["ratio"])):
        base = p["results"]["baseline"]
        ms = base.get("median_cpu_s" if metric == "speedup_cpu" else "median_s", float("nan")) * 1e3
        cells = []
        for c in contenders:
            s = p.get(metric, {}).get(c)
            cells.append(f"{s:.2f}x ({s / p['ideal']:.2f})" if s else p["results"][c].get("error", "-")[:40])
        lines.append(f"| {p['G']} | {p['ratio']:g} | {p['prefix']} | {p['ideal']:.2f}x | {ms:.1f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def pytest_benchmark_table(data: dict) -> str:
    """One row per benchmark: group, median, rounds and the scalar ``extra_info`` entries."""
    lines = ["| benchmark | group | median | rounds | extra info |", "|---|---|---|---|---|"]
    for b in data["benchmarks"]:
        extra = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in (b.get("extra_info") or {}).items() if isinstance(v, (int, float, str)))
        lines.append(f"| {b['name']} | {b.get('group') or ''} | {b['stats']['median']:.4g} s | "
                     f"{b['stats']['rounds']} | {extra} |")
    return "\n".join(lines)


_ALONE = ("alone", "each-alone", "each alone", "per-request")  # each sequence run by itself: what ideals divide
_UNGROUPED = _ALONE + ("baseline", "padded", "padded batch")        # contenders that share nothing


def _baseline_of(results: dict) -> str:
    """The contender every speedup of ``results`` is measured against (its own speedup is 1.0)."""
    return next((c for c, r in results.items() if isinstance(r, dict) and r.get("speedup") == 1.0), "?")


def workload_table(record: dict, metric: str) -> str:
    """One row per contender of a workload record: time, speedup, and, for grouped contenders, the
    speedup over each sequence alone beside the ideal (the exact work ratio of ``Layout.cost``)."""
    results, ideal = record["results"], record.get("ideal")
    base = _baseline_of(results)
    alone = next((c for c in results if c in _ALONE), None)
    lines = [f"speedup: against `{base}`; vs alone: against `{alone or '-'}` (each sequence by itself), "
             "which is what the ideal divides: a padded baseline can make a speedup exceed the ideal",
             "", "| contender | median cpu s | median wall s | speedup | vs alone | ideal | of ideal | max abs err |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        s = r.get(metric, r.get("speedup"))
        s_alone = results[alone].get(metric, results[alone].get("speedup")) if alone else None
        va = s / s_alone if s and s_alone else None
        i = ideal.get(name) if isinstance(ideal, dict) else (None if name in _UNGROUPED else ideal)
        lines.append(f"| {name} | {r.get('median_cpu_s', float('nan')):.3f} | {r.get('median_s', float('nan')):.3f} | "
                     f"{f'{s:.2f}x' if s else r.get('error', '-')} | {f'{va:.2f}x' if va else '-'} | "
                     f"{f'{i:.2f}x' if i else '-'} | {f'{va / i:.2f}' if va and i else '-'} | "
                     f"{r.get('max_abs_err', float('nan')):.2g} |")
    return "\n".join(lines)


def flat_table(data, prefix: str = "") -> str:
    """Every scalar of ``data`` as ``| key.path | value |`` (the fallback for a kind without its own table)."""
    rows = []

    def walk(x, key):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(x, list) and x and not all(isinstance(v, (int, float)) for v in x):
            for i, v in enumerate(x):
                walk(v, f"{key}[{i}]")
        else:
            rows.append(f"| {key} | {x:.4g} |" if isinstance(x, float) else f"| {key} | {x} |")

    walk(data, prefix)
    return "\n".join(["| key | value |", "|---|---|", *rows])


def summarize(path: str, metric: str | None) -> str | None:
    """The Markdown for one JSON file, or None if it is not a kind this script knows."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and "machine_info" in data and "benchmarks" in data:
        info = data.get("machine_info", {})
        return (f"{path}: pytest-benchmark, {data.get('datetime', '?')}, {info.get('cpu', {}).get('brand_raw', '')}"
                f"\n\n{pytest_benchmark_table(data)}")
    if isinstance(data, dict) and "model_points" in data:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        if "exactness" in data:
            from gpu_check import to_markdown

            return f"{path}: gpu_check.py\n\n{to_markdown(data)}"
        from gpu_bench import to_markdown

        return f"{path}: gpu_bench.py\n\n{to_markdown(data)}"
    points, header = None, ""
    if isinstance(data, dict) and "points" in data:
        points, env, cfg = data["points"], data.get("env", {}), data.get("config", {})
        header = (f"{cfg.get('level', '?')} level, model {cfg.get('model', '?')}, {env.get('torch_threads', '?')} "
                  f"thread(s), {env.get('date', '?')}, ")
        device = env.get("device", "cpu")
    elif isinstance(data, dict) and "results" in data and "ideal" in data:
        points, device = [data], "cpu"
    elif isinstance(data, list) and data and all(isinstance(p, dict) and "results" in p for p in data):
        points, device = data, "cpu"
    if isinstance(data, dict) and isinstance(data.get("workloads"), dict):
        metric = metric or "speedup_cpu"
        return "\n\n".join(f"{path}: workload {name}, metric {metric}\n\n{workload_table(w, metric)}"
                           for name, w in data["workloads"].items())
    if points and "G" not in points[0] and isinstance(points[0].get("results"), dict):
        metric = metric or "speedup_cpu"
        return "\n\n".join(f"{path}: metric {metric}\n\n{workload_table(p, metric)}" for p in points)
    if not points:
        return f"{path}: no table of its own; its values\n\n{flat_table(data)}" if data else None
    metric = metric or ("speedup_cpu" if device == "cpu" and "speedup_cpu" in points[0] else "speedup")
    return f"{path}: {header}metric {metric}\n\n{table(points, metric)}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--metric", default=None, help="speedup (wall) or speedup_cpu (process CPU time)")
    args = ap.parse_args(argv)
    status = 0
    for f in args.files:
        text = summarize(f, args.metric)
        if text is None:
            print(f"{f}: not a benchmark JSON this script knows (skipped)", file=sys.stderr)
            status = 1
        else:
            print(f"\n{text}")
    return status


if __name__ == "__main__":
    sys.exit(main())
