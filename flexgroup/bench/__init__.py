"""``flexgroup bench``: benchmarks of flexgroup against the repeated-prefix baseline and PrefixGrouper.

The package face; each idea has its module:

- :mod:`~flexgroup.bench.options`: the command lines of ``flexgroup bench`` and its workloads, without
  torch (:func:`main` parses first, so ``--help`` answers at once);
- :mod:`~flexgroup.bench.measure`: the one home of every benchmark's measuring and recording (interleaved
  timing, memory held for backward, peak RSS, CUDA peaks, the environment, result JSON), for the workloads
  here and the scripts in ``benchmarks/``;
- :mod:`~flexgroup.bench.harness`: the grid run of ``flexgroup bench`` (points, contenders checked then
  timed, plots; :func:`add_arguments`, :func:`run`);
- :mod:`~flexgroup.bench.contenders`: the baseline, flexgroup and PrefixGrouper runs that are timed;
- :mod:`~flexgroup.bench.demo`: the ``flexgroup demo`` harness;
- :mod:`~flexgroup.bench.doctor`: ``flexgroup doctor`` (versions, each built-in architecture checked here);
- :mod:`~flexgroup.bench.arguments`: the argument value types of the ``flexgroup`` command lines;
- :mod:`~flexgroup.bench.trees`, :mod:`~flexgroup.bench.hybrids`, :mod:`~flexgroup.bench.scoring`,
  :mod:`~flexgroup.bench.dta`, :mod:`~flexgroup.bench.longrow` ...: workloads with their own options
  (``flexgroup bench trees --help`` ...).

Importing the package imports no torch: the harness's and measure's names below load on first use.
"""

from __future__ import annotations

import importlib

from .options import ATTN_DEFAULT, GRIDS, MODEL_DEFAULT, MODELS, RATIOS, WORKLOADS, add_arguments, main  # noqa: F401

# names of the modules that import torch, resolved on first access (PEP 562)
_LAZY = {**dict.fromkeys(("attention_inputs", "build_model", "format_point", "plot_results", "point_record",
                          "prepare_attention_contender", "prepare_model_contender", "run", "run_attention_point",
                          "run_grid", "run_model_point"), "harness"),
         **dict.fromkeys(("HeldForBackward", "SavedForBackward", "cuda_peak", "environment", "held_peak",
                          "interleaved_medians", "median_seconds", "peak_rss_bytes", "per_rank", "rss_bytes",
                          "saved_bytes", "sync", "time_interleaved", "write_json"), "measure")}

__all__ = ["GRIDS", "MODELS", "add_arguments", "main", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module("." + _LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
