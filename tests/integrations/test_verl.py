"""flexgroup's verl engine against verl's STOCK FSDP engine (verl 0.9), on CPU.

The oracle is verl itself: ``verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead``, built
from the same checkpoint and fed the same verl-layout batch, through verl's own
``forward_backward_batch`` and ``ppo_loss`` (entropy bonus and KL loss on). Compared: every log-prob
and entropy value verl returns, the micro-batch losses and every full parameter gradient; float64
(norms kept in float64, ``KeepFloat64``) and float32; ``use_remove_padding`` on and off; GRPO groups
and multi-turn agent-loop rows (tool tokens masked by ``response_mask``); one gloo rank and FSDP2 over
two gloo ranks on 127.0.0.1. Both engines run in ``tests/integrations/_verl_harness.py`` (a fresh
interpreter per world size, with a CPU platform registered before verl's engine is imported).

Skipped, with the reason, where verl is not installed (the main suite's environment): CI runs this
module in its own environment (``.ci/verl``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl", minversion="0.9", reason="verl 0.9 is not installed (pip install 'flexgroup[verl]')")

HARNESS = Path(__file__).with_name("_verl_harness.py")
WORLDS = (1, 2)
TOL = {"fp64": (1e-12, 1e-10), "fp32": (5e-6, 2e-5)}  # (log-prob / entropy / loss abs, gradient rel to max)
TRAIN = [f"{kind}-train-{dtype}-{pad}" for kind in ("grpo", "multiturn") for dtype in ("fp64", "fp32")
         for pad in ("rmpad", "padded")]
# the engine plans the whole mini-batch (issue 29): verl's splits that scatter groups, a trie over the token
# budget, flexgroup's balance_batch share of a 2-rank batch, a loss mode kept on verl's micro-batches
PLANNED = ["grpo-half-groups-fp64", "grpo-dynamic-bsz-fp64", "multiturn-dynamic-bsz-fp32", "grpo-trie-over-budget-fp32",
           "grpo-balanced-fp32", "grpo-balanced-fp64", "grpo-seq-norm-fp32", "grpo-geo-mean-fp32",
           "grpo-uneven-ranks-fp32"]


def run_harness(harness: Path, tmp_path_factory, label: str, worlds=WORLDS) -> dict[int, list[dict]]:
    """Run ``harness OUTDIR WORLD`` for every world size at once; per world size, per rank, what it saved."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", PYTHONPATH=str(harness.parents[2]))
    outs = {w: tmp_path_factory.mktemp(f"{label}{w}") for w in worlds}
    procs = {w: subprocess.Popen([sys.executable, str(harness), str(outs[w]), str(w)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for w in worlds}
    logs = {}
    try:
        for w, proc in procs.items():
            logs[w] = proc.communicate(timeout=600)[0]
    finally:
        for proc in procs.values():
            if proc.poll() is None:  # timed out: end the harness and the ranks it spawned (its own group)
                os.killpg(proc.pid, signal.SIGKILL)
    for w, proc in procs.items():
        assert proc.returncode == 0, f"{harness.name} ({w} ranks) failed:\n{logs.get(w, '')[-8000:]}"
    return {w: [torch.load(outs[w] / f"rank{r}.pt", weights_only=False) for r in range(w)] for w in worlds}


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> dict[int, list[dict]]:
    """Per world size, per rank: {case: {engine: result}}; the harness runs for both sizes at once."""
    return run_harness(HARNESS, tmp_path_factory, "verl")


@pytest.fixture(params=WORLDS, ids=lambda w: f"{w}rank")
def ranks(request, harness) -> list[dict]:
    return harness[request.param]


def _tol(case: str) -> tuple[float, float]:
    return TOL["fp64" if "fp64" in case else "fp32"]


def _assert_same_outputs(got: dict, ref: dict, atol: float, what: str) -> None:
    assert torch.equal(got["offsets"], ref["offsets"]), f"{what}: samples laid out differently"
    for key in ("log_probs", "entropy", "loss"):
        if ref[key] is None:
            assert got[key] is None, f"{what}: {key} returned where verl returns none"
            continue
        assert got[key].shape == ref[key].shape, f"{what}: {key} shape {tuple(got[key].shape)}"
        err = (got[key].double() - ref[key].double()).abs().max().item()
        assert err <= atol, f"{what}: {key} differs from verl's stock engine by {err:.3g}"


def _assert_same_metrics(got: dict, ref: dict, atol: float, what: str) -> None:
    assert got["metrics"].keys() == ref["metrics"].keys(), f"{what}: metric names differ"
    for key, vals in ref["metrics"].items():
        assert len(got["metrics"][key]) == len(vals), f"{what}: {key} has {len(got['metrics'][key])} entries"
        err = max((abs(a - b) for a, b in zip(got["metrics"][key], vals)), default=0.0)
        assert err <= atol * max(1.0, *(abs(v) for v in vals)), f"{what}: metric {key} differs by {err:.3g}"


def _assert_same_grads(got: dict, ref: dict, rel: float, what: str) -> None:
    assert got.keys() == ref.keys(), f"{what}: gradient sets differ"
    for name, g in ref.items():
        scale = g.abs().max().item()
        assert scale > 0, f"{what}: {name} has a zero gradient in the stock run"
        err = (got[name] - g).abs().max().item()
        assert err <= rel * scale, f"{what}: {name} gradient differs by {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("case", TRAIN)
def test_log_probs_entropy_and_loss_equal_verls_stock_engine(ranks, case):
    for r, res in enumerate(ranks):
        _assert_same_outputs(res[case]["flexgroup"], res[case]["stock"], _tol(case)[0], f"{case} rank {r}")


@pytest.mark.parametrize("case", TRAIN)
def test_ppo_loss_gradients_equal_verls_stock_engine(ranks, case):
    for r, res in enumerate(ranks):
        assert len(res[case]["stock"]["grads"]) == 27  # every parameter of the tiny Qwen2
        _assert_same_grads(res[case]["flexgroup"]["grads"], res[case]["stock"]["grads"], _tol(case)[1],
                           f"{case} rank {r}")


@pytest.mark.parametrize("case", ["grpo-old-log-prob-fp32", "multiturn-ref-log-prob-fp32"])
def test_forward_only_passes_equal_verls_stock_engine(ranks, case):
    for r, res in enumerate(ranks):
        _assert_same_outputs(res[case]["flexgroup"], res[case]["stock"], _tol(case)[0], f"{case} rank {r}")


def test_per_sample_temperatures_stay_exact(ranks):
    case = "grpo-per-sample-temperature-fp32"
    for r, res in enumerate(ranks):
        assert res[case]["flexgroup"]["warnings"] == []
        _assert_same_outputs(res[case]["flexgroup"], res[case]["stock"], _tol(case)[0], f"{case} rank {r}")
        _assert_same_grads(res[case]["flexgroup"]["grads"], res[case]["stock"]["grads"], _tol(case)[1], case)


def test_dynamic_batch_size_stays_exact_and_shares_less(ranks):
    for r, res in enumerate(ranks):
        dyn, fixed = res["grpo-dynamic-bsz-fp32"], res["grpo-old-log-prob-fp32"]  # fixed: whole groups
        _assert_same_outputs(dyn["flexgroup"], dyn["stock"], 5e-6, f"dynamic bsz rank {r}")
        _assert_same_grads(dyn["flexgroup"]["grads"], dyn["stock"]["grads"], 2e-5, "dynamic bsz")
        assert fixed["flexgroup"]["stats"]["grouped_tokens"] < dyn["flexgroup"]["stats"]["grouped_tokens"] \
            < dyn["stock"]["embedded_tokens"]


def test_the_grouped_engine_feeds_the_model_fewer_tokens(ranks):
    for res in ranks:
        for case in TRAIN:
            stock, flex = res[case]["stock"], res[case]["flexgroup"]
            # an independent count (token ids entering the embedding) agrees with the engine's counters
            assert flex["embedded_tokens"] == flex["stats"]["grouped_tokens"]
            width = "real_tokens" if case.endswith("rmpad") else "padded_tokens"
            assert stock["embedded_tokens"] == flex["stats"][width]
            assert flex["embedded_tokens"] < 0.65 * stock["embedded_tokens"]


def test_a_mode_it_cannot_group_runs_verls_stock_step_with_one_warning(ranks):
    case = "multiturn-shifted-positions-fp32"  # position ids that do not start at 0
    for res in ranks:
        flex = res[case]["flexgroup"]
        assert flex["stats"]["fallback_micro_batches"] == 2 and flex["stats"]["grouped_tokens"] == 0
        assert len(flex["warnings"]) == 1 and "position_ids" in flex["warnings"][0]
        _assert_same_outputs(flex, res[case]["stock"], 0.0, case)
        _assert_same_grads(flex["grads"], res[case]["stock"]["grads"], 0.0, case)


@pytest.mark.parametrize("mode, named", [
    ("fused", "use_fused_kernels"),
    ("distillation", "distillation"), ("routing_replay", "routed_experts"), ("multimodal", "multimodal"),
    ("mrope", "M-RoPE"), ("disagreeing_responses", "disagree")])
def test_modes_that_cannot_be_grouped_are_named(ranks, mode, named):
    reasons = ranks[0]["stock_reasons"]
    assert reasons["plain"] is None
    assert reasons[mode] is not None and named in reasons[mode]


def test_a_broken_read_back_is_caught(ranks):
    # reading each token from the packed row physically before it (a later sibling's first token from
    # the previous sibling's last token): the comparison above must fail on it
    case = "grpo-train-fp32-rmpad"
    for res in ranks:
        broken, stock = res[case]["broken"], res[case]["stock"]
        with pytest.raises(AssertionError, match="log_probs differs"):
            _assert_same_outputs(broken, stock, _tol(case)[0], case)
        with pytest.raises(AssertionError, match="gradient differs"):
            _assert_same_grads(broken["grads"], stock["grads"], _tol(case)[1], case)


def test_one_config_switch_installs_the_engine(ranks):
    # actor_rollout_ref.model.external_lib=flexgroup.integrations.verl, as verl's workers import it
    assert ranks[0]["registry"] == {"before": "FSDPEngineWithLMHead", "after_external_lib": "FlexGroupFSDPEngine",
                                    "after_unregister": "FSDPEngineWithLMHead"}


def test_verls_default_flash_attention_is_built_as_sdpa_with_one_warning(ranks):
    for res in ranks:
        flex = res["verl-default-attention"]["flexgroup"]
        assert flex["attn_implementation"].endswith("sdpa")  # flexgroup_sdpa once patched
        assert len(flex["warnings"]) == 1 and "'flash_attention_2'" in flex["warnings"][0]
        _assert_same_outputs(flex, res["verl-default-attention"]["stock"], 5e-6, "verl's default attention")


@pytest.mark.parametrize("case", PLANNED)
def test_planned_mini_batches_equal_verls_stock_engine(ranks, case):
    # log-probs, entropies, per-micro-batch losses and metrics in verl's layout; every parameter gradient
    for r, res in enumerate(ranks):
        flex, stock = res[case]["flexgroup"], res[case]["stock"]
        _assert_same_outputs(flex, stock, _tol(case)[0], f"{case} rank {r}")
        _assert_same_metrics(flex, stock, _tol(case)[0], f"{case} rank {r}")
        _assert_same_grads(flex["grads"], stock["grads"], _tol(case)[1], f"{case} rank {r}")
        assert flex["embedded_tokens"] == flex["stats"]["grouped_tokens"] < stock["embedded_tokens"]


@pytest.mark.parametrize("case", TRAIN)
def test_metrics_equal_verls_stock_engine(ranks, case):
    for r, res in enumerate(ranks):
        _assert_same_metrics(res[case]["flexgroup"], res[case]["stock"], _tol(case)[0], f"{case} rank {r}")


def test_planning_shares_across_verls_micro_batches(ranks):
    for res in ranks:
        # same rows, same micro-batches of 2 (half groups): planned (seq-norm) vs kept per micro-batch (geo_mean)
        planned, kept = res["grpo-seq-norm-fp32"]["flexgroup"], res["grpo-geo-mean-fp32"]["flexgroup"]
        assert planned["warnings"] == [] and planned["stats"]["forwards"] < 6
        assert planned["stats"]["grouped_tokens"] < kept["stats"]["grouped_tokens"]
        # dynamic batch sizing no longer mixes the samples of the agent-loop rows apart: one trie, one forward
        dyn = res["multiturn-dynamic-bsz-fp32"]["flexgroup"]
        assert dyn["stats"]["grouped_tokens"] == res["multiturn-ref-log-prob-fp32"]["flexgroup"]["stats"]["grouped_tokens"]


def test_a_trie_over_the_budget_is_cut_exactly_with_one_warning(ranks):
    # budgets of 64 and 30 tokens: below the 128 a stream takes (test_verl_stream.py streams bigger budgets).
    # One warning per engine: these cases run on the same engine, in this order, and each cuts a trie
    cases = ["grpo-dynamic-bsz-fp32", "grpo-trie-over-budget-fp32", "grpo-balanced-fp32"]
    for res in ranks:
        found = [w for case in cases for w in res[case]["flexgroup"]["warnings"]]
        assert len(found) == 1 and "exceeds the per-GPU token budget (64)" in found[0], found
        assert "re-encoded" in found[0] and "below one streamed block (128 tokens" in found[0]
        assert res["grpo-trie-over-budget-fp32"]["flexgroup"]["stats"]["streamed_tries"] == 0


def test_a_loss_normalized_per_micro_batch_keeps_verls_micro_batches_with_one_warning(ranks):
    for res in ranks:
        flex = res["grpo-geo-mean-fp32"]["flexgroup"]
        assert len(flex["warnings"]) == 1 and "loss_mode='geo_mean'" in flex["warnings"][0]
        assert flex["stats"]["forwards"] == 6  # verl's 12 / 2 micro-batches, each still grouped


def test_planning_such_a_loss_anyway_is_caught_loudly(harness):
    # a broken variant: the refusal bypassed, the planned forwards' loss total differs from verl's and it raises
    message = harness[1][0]["forced_plan"]
    assert message is not None and "not a sum over samples with global normalizers" in message


def test_every_rank_runs_as_many_forwards(harness):
    # FSDP gathers parameters collectively: rank 1 (two groups) plans fewer forwards than rank 0 (three)
    # and splits its largest to match; exactness of both ranks: test_planned_mini_batches_equal_...
    import importlib.util

    from flexgroup.integrations.verl_plan import plan_forwards

    spec = importlib.util.spec_from_file_location("_verl_harness", HARNESS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    case = "grpo-uneven-ranks-fp32"
    counts = [res[case]["flexgroup"]["stats"]["forwards"] for res in harness[2]]
    assert counts[0] == counts[1]
    own = plan_forwards([torch.cat([p, r]).tolist() for p, r, _ in mod.uneven_rows(1)], 64)
    assert len(own.forwards) < counts[1]


def test_a_rank_with_fewer_samples_runs_zero_loss_padding_forwards(harness):
    # rank 0 plans 3 forwards (next-fit in trie order under a budget of 50), rank 1 holds 2 samples: it runs one
    # padding forward (zero loss, outputs dropped) so that FSDP's collectives stay in step, and stays exact
    case = "padding-forward-fp32"
    ranks = harness[2]
    counts = [res[case]["flexgroup"]["stats"]["forwards"] for res in ranks]
    assert counts == [3, 3] and [res[case]["flexgroup"]["stats"]["sequences"] for res in ranks] == [4, 2]
    for r, res in enumerate(ranks):
        flex, stock = res[case]["flexgroup"], res[case]["stock"]
        _assert_same_outputs(flex, stock, _tol(case)[0], f"{case} rank {r}")
        _assert_same_grads(flex["grads"], stock["grads"], _tol(case)[1], f"{case} rank {r}")
    # broken: the padding forward back-propagates its sample's real loss (counted twice): caught
    with pytest.raises(AssertionError, match="gradient differs"):
        _assert_same_grads(ranks[1][case]["broken-padding"]["grads"], ranks[1][case]["stock"]["grads"],
                           _tol(case)[1], case)
