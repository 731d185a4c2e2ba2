"""The command lines of ``flexgroup bench`` and its workloads, built without torch (``--help`` answers at once).

:func:`parser` returns the ``argparse`` parser of ``flexgroup bench`` (``name=None``) or of one workload
(``trees``, ``hybrids``, ``scoring``, ``stream``, ``dta``, ``longrow``); :func:`main` parses first and only then imports the
module that runs (:mod:`~flexgroup.bench.harness` or the workload's), which imports torch. Each
workload's description is the opening of its module docstring, read from the source file (no import).
The grid and model names (:data:`GRIDS`, :data:`MODELS`, ...) live here for the same reason;
``flexgroup.bench.harness`` and ``flexgroup.bench.stream_workloads`` re-export them.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["RATIOS", "GRIDS", "MODELS", "MODEL_DEFAULT", "ATTN_DEFAULT", "DESCRIPTION", "WORKLOADS",
           "STREAM_MODELS", "STREAM_WORKLOADS", "add_arguments", "parser", "main"]

RATIOS = [0.5, 1, 2, 4, 8, 16, 32]
GRIDS = {
    # the paper's grid (prefix:response ratio x G), scaled to a small model and R=32 for 2 CPU cores
    "paper": dict(ratios=RATIOS, groups=[2, 4, 8, 16], response_len=32),
    "quick": dict(ratios=[1, 4, 16], groups=[2, 8, 16], response_len=32),
    # the issue-6 target point: G=8, prefix 1024, responses 128 (use with --model llama256)
    "key": dict(ratios=[8], groups=[8], response_len=128),
}
MODELS = {
    "small": dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=1024),
    "llama256": dict(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=1024, vocab=1024),
}
MODEL_DEFAULT = ["baseline", "flexgroup", "prefix-grouper"]
ATTN_DEFAULT = ["baseline", "flexgroup", "dense-sdpa", "prefix-grouper"]

DESCRIPTION = ("Time flexgroup against the repeated-prefix baseline and PrefixGrouper on a grid of prompt:response "
               "ratios and group sizes G:\none group per point, every contender's log-probs checked against the "
               "baseline first, then one\nforward+backward timed in interleaved rounds; writes JSON and a plot.")

# ``flexgroup bench <workload> ...``: workloads with their own options (each module's ``run``)
WORKLOADS = {"trees": "agentic multi-turn batch: baseline, one-level grouping, trie (P7)",
             "hybrids": "a Qwen3.5-shaped hybrid, state forked per segment (P8)",
             "scoring": "multiple-choice log-likelihoods and a reward-model pass (P9)",
             "stream": "a group bigger than the budget, streamed (P10)",
             "dta": "a fully scored multi-turn tree, AReaL-DTA's shape at CPU scale (P11)",
             "longrow": "block-mask build time against the row length, 65K-1M tokens, and a 2M-token trie (P12)"}

# the choices of ``flexgroup bench stream`` (flexgroup.bench.stream_workloads.MODELS / WORKLOADS)
STREAM_MODELS = ("llama", "hybrid")
STREAM_WORKLOADS = ("group", "tree")

_ROUNDS = "timed rounds: every contender once per round, after one untimed round; medians reported (default {})"
_THREADS = "torch threads (torch.set_num_threads; default 1)"
_OUT = "write the record as JSON here"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``flexgroup bench`` (the grid)."""
    parser.add_argument("--level", choices=["model", "attention"], default="model",
                        help="full model forward+backward of the log-prob pass, or attention alone")
    parser.add_argument("--grid", choices=sorted(GRIDS), default="paper",
                        help="points timed (default paper: ratios 1/2..32 x G 2,4,8,16; quick: ratios 1,4,16 x G "
                             "2,8,16; key: G=8, P=1024, R=128)")
    parser.add_argument("--quick", action="store_true", help="a subset: 9 points, about 17 s wall and 15 s of CPU "
                        "time with --threads 1 on a quiet 2-core machine (measured with the lse backend; more under load)")
    parser.add_argument("--model", choices=sorted(MODELS), default="small",
                        help="random-weight Llama shape (default small: hidden 128, 2 layers; llama256: hidden 256, "
                             "4 layers)")
    parser.add_argument("--contenders", default=None,
                        help="comma list (default: model baseline,flexgroup,prefix-grouper; attention baseline,"
                             "flexgroup,dense-sdpa,prefix-grouper; prefix-grouper only when installed). All: model: "
                             "baseline,flexgroup,flexgroup-full-logits,prefix-grouper,prefix-grouper-full-logits; "
                             "attention: baseline,flexgroup,flexgroup-flex,dense-sdpa,prefix-grouper)")
    parser.add_argument("--mode", choices=["fwdbwd", "fwd"], default="fwdbwd",
                        help="forward+backward (default) or forward only; attention level only")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds per point, every contender once per round (interleaved); the median is "
                             "reported (default 3)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed rounds per point before the timed ones (default 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (torch.set_num_threads; default 1 on machines with <= 4 CPU cores, "
                             "else torch's choice)")
    parser.add_argument("--device", default="cpu", help="device of the model and inputs, e.g. cpu or cuda (default cpu)")
    parser.add_argument("--out", default="flexgroup-bench", help="output stem: writes STEM.json and STEM.png")


def _doc(module: str) -> str:
    """The docstring of ``flexgroup/bench/<module>.py``, read from its source without importing it."""
    return ast.get_docstring(ast.parse((Path(__file__).parent / f"{module}.py").read_text(encoding="utf-8"))) or ""


def _checked_rounds(ap: argparse.ArgumentParser, against: str) -> None:
    """--rounds, --threads, --seed and --atol of a workload whose contenders are checked against ``against``."""
    ap.add_argument("--rounds", type=int, default=3, help=_ROUNDS.format(3))
    ap.add_argument("--threads", type=int, default=1, help=_THREADS)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random tokens (default 0)")
    ap.add_argument("--atol", type=float, default=1e-3,
                    help=f"largest |log-prob difference| from {against} accepted before timing (default 1e-3)")


def _trees(ap: argparse.ArgumentParser) -> None:
    _checked_rounds(ap, "the baseline")
    ap.add_argument("--out", default=None, help=_OUT)
    ap.add_argument("--quick", action="store_true", help="every length / 8 (a smoke test, seconds)")
    ap.add_argument("--micro", type=int, default=4, help="rows per baseline micro-batch (within a group; default 4)")
    ap.add_argument("--backends", default="", help="comma list of extra flexgroup backends timed on the trie "
                    "as contenders 'trie-<name>' ('trie' itself runs backend auto)")


def _hybrids(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prefix", type=int, default=1024, help="prompt tokens P (default 1024)")
    ap.add_argument("--response", type=int, default=128, help="tokens per response R (default 128)")
    ap.add_argument("--groups", type=int, default=8, help="responses per prompt G (default 8)")
    ap.add_argument("--rounds", type=int, default=3, help=_ROUNDS.format(3))
    ap.add_argument("--threads", type=int, default=1, help=_THREADS)
    ap.add_argument("--out", default=None, help=_OUT)


def _scoring(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rounds", type=int, default=5, help=_ROUNDS.format(5))
    ap.add_argument("--threads", type=int, default=1, help=_THREADS)
    ap.add_argument("--questions", type=int, default=4,
                    help="multiple-choice questions, 4 choices each, after one shared few-shot context (default 4)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random tokens (default 0)")
    ap.add_argument("--quick", action="store_true", help="every length / 8 (a smoke test, seconds)")
    ap.add_argument("--out", default=None, help=_OUT)
    ap.add_argument("--backends", default="", help="comma list of extra flexgroup backends timed as contenders "
                    "'flexgroup-<name>' ('flexgroup' itself runs backend auto)")


def _stream(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workload", choices=STREAM_WORKLOADS, default="group",
                    help="group: one prompt + G responses (default); tree: a system prompt shared by multi-turn trees")
    ap.add_argument("--model", choices=STREAM_MODELS, default="llama",
                    help="llama (default) or hybrid: a Qwen3.5-shaped Gated DeltaNet + attention model")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (group: prompt 512, 4 x 128), budgets 256 / 1024")
    _checked_rounds(ap, "each sequence alone")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    ap.add_argument("--out", default=None, help=_OUT)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--size", default="full", help=argparse.SUPPRESS)


def _dta(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--system", type=int, default=None, help="system prompt tokens (default 250; --quick 32)")
    ap.add_argument("--thinking", type=int, default=None, help="thinking tokens per turn (default 125; --quick 16)")
    ap.add_argument("--response", type=int, default=None, help="response tokens per turn (default 50; --quick 8)")
    ap.add_argument("--turns", type=int, default=None, help="turns, one trajectory each (default 17; --quick 5)")
    _checked_rounds(ap, "each trajectory alone")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test, seconds)")
    ap.add_argument("--out", default=None, help=_OUT)


def _longrow(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rounds", type=int, default=9, help="rounds, every row length once per round, interleaved; "
                    "medians reported (default 9)")
    ap.add_argument("--threads", type=int, default=1, help=_THREADS)
    ap.add_argument("--quick", action="store_true", help="rows of 8K-64K tokens and a 262K-token trie (seconds)")
    ap.add_argument("--out", default=None, help=_OUT)


# workload -> (its arguments, how much of its docstring is the description: first paragraph or first line)
_WORKLOAD_ARGS = {"trees": (_trees, "paragraph"), "hybrids": (_hybrids, "line"), "scoring": (_scoring, "paragraph"),
                  "stream": (_stream, "line"), "dta": (_dta, "line"),
                  "longrow": (_longrow, "line")}


def parser(name: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``flexgroup bench`` (``name=None``) or of ``flexgroup bench NAME`` (a key of WORKLOADS)."""
    if name is None:
        ap = argparse.ArgumentParser(
            prog="flexgroup bench", description=DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,  # one workload per line, never wrapped
            epilog="other workloads (each with --help):\n" + "\n".join(f"  flexgroup bench {k}: {v}"
                                                                       for k, v in WORKLOADS.items()))
        add_arguments(ap)
        return ap
    if name not in _WORKLOAD_ARGS:
        raise ValueError(f"unknown bench workload {name!r}: choose one of {sorted(_WORKLOAD_ARGS)} or none (the grid)")
    add, part = _WORKLOAD_ARGS[name]
    doc = _doc(name)
    ap = argparse.ArgumentParser(prog=f"flexgroup bench {name}",
                                 description=doc.split("\n\n")[0] if part == "paragraph" else doc.splitlines()[0])
    add(ap)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``flexgroup bench [WORKLOAD] ...``: parse (torch-free), then import the module that runs and run it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv[0] if argv and argv[0] in WORKLOADS else None
    args = parser(name).parse_args(argv[1:] if name else argv)
    return importlib.import_module(f"flexgroup.bench.{name or 'harness'}").run(args)
