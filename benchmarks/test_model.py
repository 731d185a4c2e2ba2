"""Full model: one forward+backward of the policy log-prob pass (the part of a GRPO step that
shared prefixes change), on the grid. Contenders on deep copies of one random-weight Llama:

- baseline: stock model, sdpa, right-padded batch of the G sequences, logits for completions only;
- flexgroup: ``flexgroup.patch(model)`` (backend "auto": sdpa on CPU for training) + GroupedBatch;
- prefix-grouper: the PyPI package driven through ``flexgroup.bench.contenders.pg_exact_sdpa``.

Log-probs of every contender are checked against the baseline (atol 1e-3) before it is timed.

    pytest benchmarks/test_model.py --benchmark-only [--grid paper]
    pytest benchmarks/test_model.py --benchmark-only --grid key --bench-model llama256   # target point
"""

from __future__ import annotations

import pytest

from flexgroup.bench import build_model, prepare_model_contender
from flexgroup.bench.contenders import make_group

CONTENDERS = ["baseline", "flexgroup", "prefix-grouper"]
_CACHE: dict = {}


@pytest.fixture(scope="session")
def model(bench_model_name):
    return build_model(bench_model_name)


def _point(model, point) -> dict:
    if _CACHE.get("key") != point:
        from flexgroup import Layout
        from flexgroup.bench import point_record

        P, R, G = point
        prompt, responses = make_group(P, [R] * G, model.config.vocab_size)
        _, _, ref = prepare_model_contender("baseline", model, prompt, responses)
        _CACHE.clear()
        _CACHE.update(key=point, prompt=prompt, responses=responses, ref=ref, base_median=None,
                      rec=point_record(Layout.group(P, [R] * G), model.config, P, R, G))
    return _CACHE


@pytest.mark.parametrize("contender", CONTENDERS)
def test_model_fwdbwd(benchmark, model, point, contender, rounds, recorder):
    if contender == "prefix-grouper":
        pytest.importorskip("prefix_grouper", reason="pip install prefix-grouper")
    c = _point(model, point)
    obj, info, _ = prepare_model_contender(contender, model, c["prompt"], c["responses"], c["ref"])
    P, R, G = point
    benchmark.group = f"model fwd+bwd G={G} P={P} R={R}"
    benchmark.pedantic(obj.step, rounds=rounds, warmup_rounds=1, iterations=1)
    recorder(benchmark, c, contender, info)
