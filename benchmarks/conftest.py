"""Shared options and fixtures of the pytest-benchmark suites (run explicitly, never by plain ``pytest``).

    pytest benchmarks/ --benchmark-only                       # quick grid, a few minutes on 2 cores
    pytest benchmarks/ --benchmark-only --grid paper          # the paper's grid (ratios 1/2..32, G 2..16)
    pytest benchmarks/test_model.py --benchmark-only --grid key --bench-model llama256   # the target point

Options: ``--grid quick|paper|key``, ``--bench-model small|llama256``, ``--rounds N``, ``--threads N``
(torch threads; default 1, which keeps ratios stable on a shared machine; 0 = torch's default).
Every point records its metadata in the benchmark's ``extra_info`` (see ``--benchmark-json``).
"""

from __future__ import annotations

import pytest
import torch

from flexgroup.bench import GRIDS, MODELS


def pytest_addoption(parser):
    g = parser.getgroup("flexgroup benchmarks")
    g.addoption("--grid", default="quick", choices=sorted(GRIDS), help="grid of (prefix:response ratio, G)")
    g.addoption("--bench-model", default="small", choices=sorted(MODELS), help="random-weight Llama shape")
    g.addoption("--rounds", type=int, default=3, help="timed rounds per benchmark (median reported)")
    g.addoption("--threads", type=int, default=1, help="torch.set_num_threads (0: leave torch's default)")


def pytest_configure(config):
    n = config.getoption("--threads", default=0)
    if n:
        torch.set_num_threads(n)


def grid_points(config) -> list[tuple[int, int, int]]:
    spec = GRIDS[config.getoption("--grid")]
    R = spec["response_len"]
    return [(max(1, round(r * R)), R, G) for G in spec["groups"] for r in spec["ratios"]]


def pytest_generate_tests(metafunc):
    if "point" in metafunc.fixturenames:
        pts = grid_points(metafunc.config)
        metafunc.parametrize("point", pts, ids=[f"G{G}-P{P}-R{R}" for P, R, G in pts], scope="module")


@pytest.fixture(scope="session")
def rounds(request) -> int:
    return request.config.getoption("--rounds")


@pytest.fixture(scope="session")
def bench_model_name(request) -> str:
    return request.config.getoption("--bench-model")


@pytest.fixture
def recorder():
    """``recorder(benchmark, point_cache, name, info)``: metadata into ``benchmark.extra_info``.

    Stores tokens, attention pairs, the ideal ratio, memory and the error against the baseline;
    the baseline's median is remembered per point so later contenders also get ``speedup``.
    """

    def rec(benchmark, cache: dict, name: str, info: dict) -> None:
        p = cache["rec"]
        median = benchmark.stats.stats.median
        if name == "baseline":
            cache["base_median"] = median
        extra = dict(contender=name, prefix=p["prefix"], response=p["response"], G=p["G"], ratio=p["ratio"],
                     tokens=p["tokens"], pairs=p["pairs"], ideal=p["ideal"], threads=torch.get_num_threads(),
                     median_s=median, **info)
        if cache.get("base_median"):
            extra["speedup"] = cache["base_median"] / median
            extra["speedup_over_ideal"] = extra["speedup"] / p["ideal"]
        benchmark.extra_info.update(extra)

    return rec
