"""Markdown tables from the benchmark JSON files in benchmarks/results/ (used for benchmarks/README.md).

    python benchmarks/summarize.py benchmarks/results/*.json [--metric speedup|speedup_cpu]

Reads every kind this folder writes: ``flexgroup bench`` grids (``env``/``config``/``points``), single
points or lists of points (the same records without the run header), pytest-benchmark files
(``--benchmark-json``: ``machine_info``/``benchmarks``) and ``gpu_bench.py`` results (``model_points``).
A file of another kind is named on stderr and skipped (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def table(points: list[dict], metric: str) -> str:
    """One row per (G, prefix:response ratio) point: ideal, baseline time, each contender's speedup."""
    contenders = [n for n in points[0]["results"] if n != "baseline"]
    head = "| G | P:R | P | ideal | baseline ms | " + " | ".join(f"{c} (of ideal)" for c in contenders) + " |"
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
    if isinstance(data, dict) and "budgets" in data and "packed_tokens" in data:  # flexgroup bench stream (P10)
        from flexgroup.bench.stream import table as stream_table

        return f"{path}: flexgroup bench stream\n\n{stream_table(data)}"
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
    if not points:
        return None
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
