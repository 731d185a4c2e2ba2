"""``flexgroup bench``: benchmarks of flexgroup against the repeated-prefix baseline and PrefixGrouper.

The package face; each idea has its module:

- :mod:`~flexgroup.bench.harness`: grids, timing (interleaved rounds), memory, JSON and plots,
  the ``flexgroup bench`` command (:func:`main`, :func:`add_arguments`, :func:`run`);
- :mod:`~flexgroup.bench.contenders`: the baseline, flexgroup and PrefixGrouper runs that are timed;
- :mod:`~flexgroup.bench.demo`: the ``flexgroup demo`` harness;
- :mod:`~flexgroup.bench.trees`, :mod:`~flexgroup.bench.hybrids`, :mod:`~flexgroup.bench.scoring`:
  workloads with their own options (``flexgroup bench trees --help`` ...).
"""

from __future__ import annotations

from .harness import (ATTN_DEFAULT, GRIDS, MODEL_DEFAULT, MODELS, RATIOS, WORKLOADS, _point_meta,  # noqa: F401
                      add_arguments, attention_inputs, build_model, cuda_peak, environment, format_point, main,
                      plot_results, prepare_attention_contender, prepare_model_contender, run, run_attention_point,
                      run_grid, run_model_point, saved_bytes, time_interleaved)

__all__ = ["GRIDS", "MODELS", "time_interleaved", "saved_bytes", "format_point", "build_model", "run_model_point",
           "run_attention_point", "prepare_model_contender", "prepare_attention_contender", "attention_inputs",
           "run_grid", "plot_results", "add_arguments", "run", "main", "environment"]
