"""Peak memory of ``flexgroup.verify`` per calibration, each in a fresh process.

    python benchmarks/verify_memory.py --out benchmarks/results/verify-memory.json

One random Llama (``--hidden``, ``--layers``, ``--vocab``; float32) and one group (a 64-token prompt,
responses of 16, 8, 24 tokens) through ``flexgroup.verify(model, batch, calibration=C)`` for C in
``float64`` (a float64 copy of the stock model), ``layerwise`` (the same truth from the float32 stock
copy, one block's weights in float64 at a time) and ``none`` (no calibration run: the floor under
both), and ``auto`` (what verify picks from its measured peaks and the memory left). Each runs in its
own subprocess; reported: the peak resident set (``VmHWM``), the resident
set after the model was built (before verify), their difference, and process CPU time of verify (1
torch thread; the machine is shared, so CPU times are indicative only). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CALIBRATIONS = ("none", "layerwise", "float64", "auto")


def child(args) -> dict:
    import torch

    from flexgroup import GroupedBatch, verify
    from flexgroup.bench.measure import peak_rss_bytes
    from flexgroup.models.zoo import build_model

    torch.set_num_threads(1)
    model = build_model("llama", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                        num_key_value_heads=args.hidden // 128, vocab_size=args.vocab).float()
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, args.vocab, (n,), generator=g)  # noqa: E731
    batch = GroupedBatch.from_groups([ids(64)], [[ids(16), ids(8), ids(24)]])
    setup = peak_rss_bytes()
    t0 = time.process_time()
    report = verify(model, batch, calibration=args.child)
    return dict(calibration=args.child, chosen=report.calibration, params=sum(p.numel() for p in model.parameters()), rss_setup=setup,
                rss_peak=peak_rss_bytes(), cpu_s=time.process_time() - t0, ok=report.ok,
                grads_stock_error=report["grads"].stock_error)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out")
    ap.add_argument("--child", choices=CALIBRATIONS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    rows = []
    for c in CALIBRATIONS:
        cmd = [sys.executable, __file__, "--child", c, "--hidden", str(args.hidden), "--layers", str(args.layers),
               "--vocab", str(args.vocab)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    gib = 2 ** 30
    n = rows[0]["params"]
    print(f"random llama, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {n / 1e6:.0f}M parameters "
          f"(float32 {4 * n / gib:.2f} GiB, a float64 copy {8 * n / gib:.2f} GiB)\n")
    print("| calibration | peak RSS | RSS after setup | verify's peak above setup (x float32 model) | CPU s | verdict | "
          "stock grad error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        name = r["calibration"] + (f" -> {r['chosen']}" if r.get("chosen", r["calibration"]) != r["calibration"] else "")
        print(f"| {name} | {r['rss_peak'] / gib:.2f} GiB | {r['rss_setup'] / gib:.2f} GiB | "
              f"{(r['rss_peak'] - r['rss_setup']) / gib:.2f} GiB ({(r['rss_peak'] - r['rss_setup']) / (4 * n):.2f}) | "
              f"{r['cpu_s']:.1f} | {'yes' if r['ok'] else 'no'} | "
              f"{r['grads_stock_error'] if r['grads_stock_error'] is not None else '-'} |")
    if args.out:
        from flexgroup.bench.measure import write_json

        write_json(dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab, rows=rows), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
