"""Markdown tables from ``flexgroup bench`` JSON files (used for benchmarks/README.md).

    python benchmarks/summarize.py benchmarks/results/paper-model-1t.json [--metric speedup|speedup_cpu]
"""

from __future__ import annotations

import argparse
import json


def table(data: dict, metric: str) -> str:
    pts = data["points"]
    contenders = [n for n in pts[0]["results"] if n != "baseline"]
    head = "| G | P:R | P | ideal | baseline ms | " + " | ".join(f"{c} (of ideal)" for c in contenders) + " |"
    lines = [head, "|" + "---|" * (5 + len(contenders))]
    for p in sorted(pts, key=lambda p: (p["G"], p["ratio"])):
        base = p["results"]["baseline"]
        ms = base.get("median_cpu_s" if metric == "speedup_cpu" else "median_s", float("nan")) * 1e3
        cells = []
        for c in contenders:
            s = p.get(metric, {}).get(c)
            cells.append(f"{s:.2f}x ({s / p['ideal']:.2f})" if s else p["results"][c].get("error", "-")[:40])
        ratio = f"{p['ratio']:g}"
        lines.append(f"| {p['G']} | {ratio} | {p['prefix']} | {p['ideal']:.2f}x | {ms:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--metric", default=None, help="speedup (wall) or speedup_cpu (process CPU time)")
    args = ap.parse_args(argv)
    for f in args.files:
        data = json.load(open(f))
        metric = args.metric or ("speedup_cpu" if data["env"]["device"] == "cpu" else "speedup")
        cfg = data["config"]
        print(f"\n{f}: {cfg['level']} level, model {cfg['model']}, {data['env']['torch_threads']} thread(s), "
              f"{data['env']['date']}, metric {metric}\n")
        print(table(data, metric))


if __name__ == "__main__":
    main()
