"""``flexgroup bench``: benchmarks of flexgroup against the repeated-prefix baseline and PrefixGrouper.

The package face; each idea has its module:

- :mod:`~flexgroup.bench.options`: the command lines of ``flexgroup bench`` and its workloads, without
  torch (:func:`main` parses first, so ``--help`` answers at once);
- :mod:`~flexgroup.bench.harness`: grids, timing (interleaved rounds), memory, JSON and plots,
  the grid run of ``flexgroup bench`` (:func:`add_arguments`, :func:`run`);
- :mod:`~flexgroup.bench.contenders`: the baseline, flexgroup and PrefixGrouper runs that are timed;
- :mod:`~flexgroup.bench.demo`: the ``flexgroup demo`` harness;
- :mod:`~flexgroup.bench.doctor`: ``flexgroup doctor`` (versions, each built-in architecture checked here);
- :mod:`~flexgroup.bench.arguments`: the argument value types of the ``flexgroup`` command lines;
- :mod:`~flexgroup.bench.trees`, :mod:`~flexgroup.bench.hybrids`, :mod:`~flexgroup.bench.scoring`,
  :mod:`~flexgroup.bench.dta`, :mod:`~flexgroup.bench.longrow` ...: workloads with their own options
  (``flexgroup bench trees --help`` ...).

Importing the package imports no torch: the harness's names below load on first use.
"""

from __future__ import annotations

import importlib

from .options import ATTN_DEFAULT, GRIDS, MODEL_DEFAULT, MODELS, RATIOS, WORKLOADS, add_arguments, main  # noqa: F401

# names of flexgroup.bench.harness, which imports torch: resolved on first access (PEP 562)
_HARNESS = ("_point_meta", "attention_inputs", "build_model", "cuda_peak", "environment", "format_point",
            "plot_results", "prepare_attention_contender", "prepare_model_contender", "run", "run_attention_point",
            "run_grid", "run_model_point", "saved_bytes", "time_interleaved")

__all__ = ["GRIDS", "MODELS", "time_interleaved", "saved_bytes", "format_point", "build_model", "run_model_point",
           "run_attention_point", "prepare_model_contender", "prepare_attention_contender", "attention_inputs",
           "run_grid", "plot_results", "add_arguments", "run", "main", "environment"]


def __getattr__(name: str):
    if name in _HARNESS:
        value = getattr(importlib.import_module(".harness", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HARNESS))
