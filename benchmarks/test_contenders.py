"""Plain tests (not benchmarks) of the contenders and the bench runner: run before trusting any timing.

    pytest benchmarks/test_contenders.py -q        # ~30 s; skipped by --benchmark-only

The oracle is the stock model run on each [prompt; response_i] alone (a padded batch): the baseline
contender is checked against per-sequence runs, the others against the baseline, and a wrongly
aligned PrefixGrouper adapter must be caught.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import flexgroup.bench.contenders as C
from flexgroup.reference.oracle import logprobs_alone
from flexgroup.bench import plot_results, run_attention_point, run_grid

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = C.llama_config(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=100)
    prompt, responses = C.make_group(23, [5, 9, 7], 100)
    return LlamaForCausalLM(cfg).double().train(), prompt, responses


def _alone(model, prompt, responses) -> torch.Tensor:
    """Per-sequence oracle: log p(r_t | P, r_<t) from the stock model on [P; r] alone, [G, Rmax]."""
    out = torch.zeros(len(responses), max(len(r) for r in responses), dtype=torch.float64)
    for i, r in enumerate(responses):
        out[i, :len(r)] = logprobs_alone(model, torch.cat([prompt, r]))[len(prompt) - 1:]
    return out


@pytest.mark.parametrize("name", list(C.MODEL_CONTENDERS))
def test_model_contender_matches_per_sequence_oracle(tiny, name):
    if name.startswith("prefix-grouper"):
        pytest.importorskip("prefix_grouper")
    model, prompt, responses = tiny
    with torch.no_grad():
        ref = _alone(model, prompt, responses)
    c = C.MODEL_CONTENDERS[name](model, prompt, responses)
    lp = c.logprobs()
    assert (lp.detach() - ref).abs().max() < 1e-6
    c.step()
    assert all(p.grad is not None for p in c.model.parameters() if p.requires_grad)


def test_wrong_pg_alignment_is_caught(tiny, monkeypatch):
    pytest.importorskip("prefix_grouper")
    model, prompt, responses = tiny

    def top_left(q, k, v, key_valid, *, scale=None):  # what a plain is_causal SDPA call would do
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)

    monkeypatch.setattr(C, "pg_exact_sdpa", top_left)
    c = C.PrefixGrouperContender(model, prompt, responses)
    with torch.no_grad():
        err = (c.logprobs() - _alone(model, prompt, responses)).abs().max()
    assert err > 1e-2


@pytest.mark.parametrize("mode", ["fwdbwd", "fwd"])
def test_attention_point_checks_and_records(mode):
    names = ["flexgroup", "dense-sdpa"] + (["prefix-grouper"] if C.pg_available() else [])
    rec = run_attention_point(40, 12, 3, names, mode=mode, heads=4, kv_heads=2, head_dim=32, repeats=1)
    for n in ["baseline", *names]:
        r = rec["results"][n]
        assert "error" not in r, r
        assert r["max_abs_err"] < 1e-4 and r["median_s"] > 0
    assert rec["pairs"]["grouped"] < rec["pairs"]["baseline"]


def test_run_grid_writes_json_and_plot(tmp_path):
    grid = dict(ratios=[1, 4], groups=[2], response_len=8)
    data = run_grid("model", grid, dict(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=64),
                    repeats=1, warmup=0, log=lambda s: None)
    assert len(data["points"]) == 2
    for p in data["points"]:
        assert all("error" not in r for r in p["results"].values()), p["results"]
        assert p["ideal"] > 1 and set(p["speedup"]) >= {"baseline", "flexgroup"}
    json.dumps(data)
    if plot_results(data, str(tmp_path / "x.png")):
        assert (tmp_path / "x.png").stat().st_size > 0
