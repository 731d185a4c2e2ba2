"""P12: long packed rows -- BlockMask build time against the row length (cold, 1 thread), and a 2M-token trie.

The rows (issue 39): one packed row of 8,192-token groups (a 4,096-token prompt and 8 responses of 512),
65,536 to 1,048,576 tokens, causal and with a 512-token sliding window. Every round builds every (pattern,
size) once, interleaved (the load of a shared machine drifts), each from a fresh ``Layout`` with flexgroup's
caches cleared: the layout's per-token tables, the mask_mod's and the BlockMask are all built anew
(``flexgroup.layout.masks.block_mask``, block size 128), as the first forward of a new row builds them.
The trie: 32 groups of 8 sequences of 8,192 tokens (the 4,096-token prompt shared within a group), 2,097,152
input tokens as lists of ints, ``build_trie``.

Reported: medians of the rounds, process CPU time (the growth exponents are taken on it: another
process's load does not count, the page faults of the block tables do), wall time, minor page faults; beside
each time the ideal, linear growth from the smallest row; the growth exponent log2(t(2n) / t(n)) between
consecutive sizes. Targets (issue 39): 524,288 tokens <= 250 ms, exponent 262K -> 524K <= 1.2, 65,536 tokens
<= 20 ms, the 2M-token trie <= 1 s.

    flexgroup bench longrow [--rounds 9] [--quick] [--out benchmarks/results/longrow-1t.json]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from flexgroup import Layout, patterns as P
from flexgroup import caches
from flexgroup.layout import masks
from flexgroup.layout.trie import build_trie
from .measure import environment, finish_workload

try:
    import resource  # minor page faults (POSIX)
except ImportError:  # pragma: no cover - Windows: no fault counts
    resource = None

PROMPT, RESPONSES, RESPONSE = 4096, 8, 512  # 8,192 tokens per group
SIZES = [65_536, 131_072, 262_144, 524_288, 1_048_576]
QUICK_SIZES = [8_192, 16_384, 32_768, 65_536]
TRIE = dict(groups=32, per_group=8, tokens=8192)
QUICK_TRIE = dict(groups=4, per_group=8, tokens=8192)
TARGETS = {"mask_65536_ms": 20.0, "mask_524288_ms": 250.0, "exponent_262144_524288": 1.2, "trie_2m_ms": 1000.0}
PATTERNS = {"causal": None, "sliding_window_512": P.sliding_window(512)}


def row(tokens: int) -> Layout:
    """One packed row of ``tokens // 8192`` groups (prompt 4,096, 8 responses of 512)."""
    return Layout.pack([Layout.group(PROMPT, [RESPONSE] * RESPONSES) for _ in range(tokens // 8192)])


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def mask_times(sizes: list[int], rounds: int) -> dict:
    """``{pattern: {str(tokens): {"cpu_ms", "wall_ms", "faults"}}}``: medians over ``rounds`` interleaved rounds."""
    raw = {name: {n: [] for n in sizes} for name in PATTERNS}
    for _ in range(rounds):
        for name, pattern in PATTERNS.items():
            for n in sizes:
                lay = row(n)  # fresh: no cached per-token table
                caches.clear()
                f0, c0, t0 = _faults(), time.process_time(), time.perf_counter()
                masks.block_mask(lay, pattern)
                raw[name][n].append((1e3 * (time.process_time() - c0), 1e3 * (time.perf_counter() - t0),
                                     _faults() - f0))
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    return {name: {str(n): dict(cpu_ms=med(xs, 0), wall_ms=med(xs, 1), faults=med(xs, 2)) for n, xs in per.items()}
            for name, per in raw.items()}


def exponents(times: dict, sizes: list[int]) -> dict:
    """``{pattern: {"n->2n": log2(cpu(2n) / cpu(n))}}`` between consecutive sizes."""
    return {name: {f"{a}->{b}": math.log(per[str(b)]["cpu_ms"] / per[str(a)]["cpu_ms"], b / a)
                   for a, b in zip(sizes, sizes[1:])} for name, per in times.items()}


def trie_time(groups: int, per_group: int, tokens: int, rounds: int) -> dict:
    """``build_trie`` over ``groups * per_group`` sequences of ``tokens`` (the first half shared in a group)."""
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(groups):
        prompt = torch.randint(0, 150_000, (tokens // 2,), generator=g)
        seqs += [torch.cat([prompt, torch.randint(0, 150_000, (tokens - tokens // 2,), generator=g)]).tolist()
                 for _ in range(per_group)]
    times, trie = [], None
    for _ in range(rounds):
        c0 = time.process_time()
        trie = build_trie(seqs)
        times.append(1e3 * (time.process_time() - c0))
    return dict(cpu_ms=statistics.median(times), input_tokens=sum(map(len, seqs)), nodes=trie.num_tokens)


def run(args: argparse.Namespace) -> int:
    """Run the workload with parsed ``args``; returns the exit status."""
    torch.set_num_threads(args.threads)
    sizes = QUICK_SIZES if args.quick else SIZES
    for pattern in PATTERNS.values():  # imports and first-call costs out of the timings
        masks.block_mask(row(8192), pattern)
    load = [os.getloadavg()[0]] if hasattr(os, "getloadavg") else []
    rec = dict(environment=environment(), rounds=args.rounds, sizes=sizes, block_size=128, targets=TARGETS,
               group=dict(prompt=PROMPT, responses=RESPONSES, response=RESPONSE))
    rec["mask"] = mask_times(sizes, args.rounds)
    rec["exponent"] = exponents(rec["mask"], sizes)
    rec["trie"] = trie_time(**(QUICK_TRIE if args.quick else TRIE), rounds=args.rounds)
    if load:
        load.append(os.getloadavg()[0])
    rec["load_avg_1min"] = load
    return finish_workload(rec, table(rec), args.out)


def table(rec: dict) -> str:
    """Markdown table of one run: per size, each pattern's CPU ms (ideal: linear from the smallest row)."""
    sizes, mask, names = rec["sizes"], rec["mask"], list(rec["mask"])
    cols = ["tokens", "blocks"] + [f"{n} {c}" for n in names for c in ("CPU ms", "ideal ms", "exponent")] + [
        "causal wall ms", "causal faults", "target"]
    lines = [f"BlockMask of one packed row of {rec['group']['prompt'] + rec['group']['responses'] * rec['group']['response']:,}"
             f"-token groups, cold, {rec['environment']['torch_threads']} thread(s), medians of {rec['rounds']} "
             "interleaved rounds; ideal: linear growth from the smallest row; exponent: log2 of the CPU-time ratio to "
             "the row half as long", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    first = sizes[0]
    for n in sizes:
        cells = [f"{n:,}", f"{-(-n // rec['block_size']):,}"]
        for name in names:
            t = mask[name][str(n)]["cpu_ms"]
            e = rec["exponent"][name].get(f"{n // 2}->{n}")
            cells += [f"**{t:.1f}**", f"{mask[name][str(first)]['cpu_ms'] * n / first:.1f}",
                      "" if e is None else f"{e:.2f}"]
        causal = mask["causal"][str(n)]
        target = {65_536: "<= 20 ms", 524_288: "<= 250 ms, exponent <= 1.2"}.get(n, "")
        cells += [f"{causal['wall_ms']:.1f}", f"{causal['faults']:,.0f}", target]
        lines.append("| " + " | ".join(cells) + " |")
    tr = rec["trie"]
    lines += ["", f"`build_trie`: {tr['input_tokens']:,} input tokens ({tr['nodes']:,} nodes) in **{tr['cpu_ms']:.0f} "
              "ms** of CPU time (target for 2,097,152 tokens: <= 1,000 ms).",
              "1-minute load average before / after: " + ", ".join(f"{x:.1f}" for x in rec["load_avg_1min"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    """``flexgroup bench longrow ...`` (the options: :func:`flexgroup.bench.options.parser`)."""
    from .options import parser

    return run(parser("longrow").parse_args(argv))
