"""Attention alone, on the grid: baseline (padded batch of G sequences, causal SDPA) versus
``flexgroup.attention`` (sdpa backend: exact, forward+backward on CPU; flex: forward only on CPU),
dense-mask SDPA on the packed row, and the PrefixGrouper two-call algorithm (package + exact adapter).

Every contender's outputs (and, for fwd+bwd, q/k/v gradients) are checked against the baseline at
each point before it is timed; a mismatch fails the test and nothing is timed.

    pytest benchmarks/test_attention.py --benchmark-only [--grid paper] [--bench-model llama256]
"""

from __future__ import annotations

import pytest

from flexgroup.bench import MODELS, attention_inputs, prepare_attention_contender

FWD_BWD = ["baseline", "flexgroup", "dense-sdpa", "prefix-grouper"]
FWD = ["baseline", "flexgroup", "flexgroup-flex", "dense-sdpa", "prefix-grouper"]
_CACHE: dict = {}


def _point(point, mode: str, model: str) -> dict:
    key = (point, mode, model)
    if _CACHE.get("key") != key:  # one point at a time (tests run point-major)
        P, R, G = point
        sh = MODELS[model]
        x, gout, rec = attention_inputs(P, R, G, mode, sh["heads"], sh["kv_heads"], sh["hidden"] // sh["heads"])
        _, _, ref = prepare_attention_contender("baseline", x, gout, mode)
        _CACHE.clear()
        _CACHE.update(key=key, x=x, gout=gout, rec=rec, ref=ref, base_median=None)
    return _CACHE


def _bench(benchmark, point, contender, mode, rounds, model, recorder):
    if contender == "prefix-grouper":
        pytest.importorskip("prefix_grouper", reason="pip install prefix-grouper")
    c = _point(point, mode, model)
    step, info, _ = prepare_attention_contender(contender, c["x"], c["gout"], mode, c["ref"])
    P, R, G = point
    benchmark.group = f"attention {mode} G={G} P={P} R={R}"
    benchmark.pedantic(step, rounds=rounds, warmup_rounds=1, iterations=1)
    recorder(benchmark, c, contender, info)


@pytest.mark.parametrize("contender", FWD_BWD)
def test_attention_fwdbwd(benchmark, point, contender, rounds, bench_model_name, recorder):
    _bench(benchmark, point, contender, "fwdbwd", rounds, bench_model_name, recorder)


@pytest.mark.parametrize("contender", FWD)
def test_attention_fwd(benchmark, point, contender, rounds, bench_model_name, recorder):
    _bench(benchmark, point, contender, "fwd", rounds, bench_model_name, recorder)
