"""Block mask and trie build time against the row length (issue 39, item 3): cold, 1 CPU thread.

    python benchmarks/mask_scale.py [--rounds 9] [--out benchmarks/results/mask-scale-1t] [--before old.json]

``--out PATH`` writes PATH.json and PATH.md (the table, targets beside; ``--before``: a run of an
earlier flexgroup, the same script under its PYTHONPATH, as a column).

Rows: one packed row of 8,192-token groups (a 4,096-token prompt and 8 responses of 512), 65,536 to
524,288 tokens (and 1,048,576), causal and with a 512-token sliding window; each round builds a fresh
``Layout`` with the block-mask cache cleared, so the layout metadata, the mask_mod's token tables and
the BlockMask are all built anew (``masks.block_mask``, block size 128). The trie: 32 groups of 8
sequences of 8,192 tokens (the 4,096-token prompt shared within a group) = 2,097,152 input tokens as
lists of ints, ``build_trie``. Medians of ``--rounds`` (sizes interleaved within a round), wall and
process CPU time; the growth exponent is taken on CPU time (the machine is shared), and the 1-minute
load average is recorded. Targets (issue 39): 524K-token BlockMask <= 250 ms, growth exponent 262K -> 524K
<= 1.2, 65K <= 20 ms (P4), trie of 2M tokens <= 1 s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

from flexgroup import Layout, patterns as P
from flexgroup.bench import environment
from flexgroup.layout import masks
from flexgroup.layout.trie import build_trie

PROMPT, RESPONSES, RESPONSE = 4096, 8, 512  # 8,192 tokens per group
SIZES = [65_536, 131_072, 262_144, 524_288, 1_048_576]
TARGETS = {"65536": 20.0, "524288": 250.0, "exponent_262k_524k": 1.2, "trie_2m_ms": 1000.0}


def row(tokens: int) -> Layout:
    return Layout.pack([Layout.group(PROMPT, [RESPONSE] * RESPONSES) for _ in range(tokens // 8192)])


def mask_ms(pattern, rounds: int) -> tuple[dict, dict]:
    """Median wall and process-CPU ms per size; sizes interleaved within each round (the load drifts)."""
    wall: dict = {n: [] for n in SIZES}
    cpu: dict = {n: [] for n in SIZES}
    for _ in range(rounds):
        for n in SIZES:
            lay = row(n)
            masks._BLOCK_MASKS.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            masks.block_mask(lay, pattern)
            wall[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)
    med = lambda d: {str(n): 1e3 * statistics.median(v) for n, v in d.items()}  # noqa: E731
    return med(wall), med(cpu)


def trie_ms(rounds: int) -> tuple[float, int, int]:
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(32):
        prompt = torch.randint(0, 150_000, (PROMPT,), generator=g)
        seqs += [torch.cat([prompt, torch.randint(0, 150_000, (8192 - PROMPT,), generator=g)]).tolist()
                 for _ in range(8)]
    times, trie = [], None
    for _ in range(rounds):
        t0 = time.perf_counter()
        trie = build_trie(seqs)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), sum(map(len, seqs)), trie.num_tokens


def markdown(r: dict, before: dict | None) -> str:
    cols = ["tokens"] + [f"{name} ms" + (" (before)" if b else "") for name in r["mask_ms"]
                         for b in ([True, False] if before else [False])] + ["causal CPU ms", "target"]
    lines = ["Wall ms (median), and the causal row's process CPU ms (user + system: the page faults of the "
             "block tables count, another process's load does not).", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for n in SIZES:
        cells = [f"{n:,}"]
        for name in r["mask_ms"]:
            was_ms = [f"{before['mask_ms'][name][str(n)]:.0f}"] if before else []
            cells += was_ms + [f"**{r['mask_ms'][name][str(n)]:.0f}**"]
        cells.append(f"{r['mask_cpu_ms']['causal'][str(n)]:.0f}")
        lines.append("| " + " | ".join(cells + [{65_536: "<= 20", 524_288: "<= 250"}.get(n, "")]) + " |")
    was = (lambda k, f: f" (before: {f.format(before[k])})") if before else (lambda k, f: "")
    lines += ["", "Growth exponent (causal, process CPU time) 262,144 -> 524,288 tokens: "
              f"**{r['exponent_262k_524k']:.2f}**"
              f"{was('exponent_262k_524k', '{:.2f}')}; target <= 1.2. From 524,288 to 1,048,576: "
              f"**{r['exponent_524k_1m']:.2f}**.",
              f"`build_trie`, {r['trie_input_tokens']:,} input tokens ({r['trie_nodes']:,} nodes): "
              f"**{r['trie_2m_ms']:.0f} ms**{was('trie_2m_ms', '{:.0f} ms')}; target <= 1,000 ms.",
              f"Medians of {r['rounds']} rounds, 1 thread, {r['env']['date']}; 1-minute load average "
              f"{', '.join(f'{x:.1f}' for x in r['load_avg_1min'])} on 2 shared cores."]
    if before:
        lines.append(f"Before: flexgroup at {before['env']['versions']['flexgroup']}, the same script, medians of "
                     f"{before['rounds']} rounds, {before['env']['date']}, load average "
                     f"{', '.join(f'{x:.1f}' for x in before['load_avg_1min'])}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=None, help="PATH: writes PATH.json and PATH.md")
    ap.add_argument("--before", default=None, help="JSON of an earlier run, shown as a column")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    masks.block_mask(row(8192))  # imports and first-call costs out of the timings
    load = [os.getloadavg()[0]]
    result = {"env": environment(), "rounds": args.rounds, "targets": TARGETS, "mask_ms": {}, "mask_cpu_ms": {}}
    for name, pattern in (("causal", None), ("sliding_window_512", P.sliding_window(512))):
        result["mask_ms"][name], result["mask_cpu_ms"][name] = mask_ms(pattern, args.rounds)
        load.append(os.getloadavg()[0])
    ms = result["mask_cpu_ms"]["causal"]
    result["exponent_262k_524k"] = math.log2(ms["524288"] / ms["262144"])
    result["exponent_524k_1m"] = math.log2(ms["1048576"] / ms["524288"])
    result["trie_2m_ms"], result["trie_input_tokens"], result["trie_nodes"] = trie_ms(args.rounds)
    load.append(os.getloadavg()[0])
    result["load_avg_1min"] = load
    print(json.dumps({k: v for k, v in result.items() if k != "env"}, indent=1))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        before = None
        if args.before:
            with open(args.before) as f:
                before = json.load(f)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(result, before))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
