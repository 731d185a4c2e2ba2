"""verl's trainer loop end to end on CPU: two GRPO steps, verl's STOCK engine vs flexgroup's (verl 0.9).

verl's ``main_ppo`` needs an inference-server rollout (vLLM, SGLang, TensorRT-LLM), so
``tests/integrations/_verl_e2e_harness.py`` drives the rest of a ``RayPPOTrainer`` step in-process (no Ray):
verl's Hydra config with the overrides recorded in docs/verl.md, verl's ``ActorRolloutRefWorker`` (actor
and reference), and the trainer's own ``_compute_old_log_prob``, ``_compute_ref_log_prob``,
``compute_advantage`` (GRPO) and ``_update_actor`` (2 PPO epochs, micro-batches of 2 that split groups),
on replayed rollouts (3 prompts x 4 responses per step, seeded). The only difference between the runs is
``actor_rollout_ref.model.external_lib=flexgroup.integrations.verl``. float32: flexgroup's packed forward
sums in another order than verl's, so results agree within float32 noise, not bit for bit. A broken
engine (each token read from the packed row before it) must be caught by the same comparisons.

Skipped where verl is not installed (CI runs it in ``.ci/verl``'s environment).
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

HARNESS = Path(__file__).with_name("_verl_e2e_harness.py")
LOGP_TOL = 5e-6      # float32 log-probs (abs), as tests/integrations/test_verl.py (measured: 4.8e-7)
METRIC_TOL = 1e-6    # verl's actor metrics, relative to 1 + |value| (measured: up to 4.7e-8)
WEIGHT_TOL = 1e-5    # parameters after two Adam steps of lr 1e-3 (abs): 1 % of one step (measured: 7.1e-7)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("verl_e2e")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HARNESS.parents[2]))
    proc = subprocess.Popen([sys.executable, str(HARNESS), str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log = proc.communicate(timeout=600)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"verl e2e harness failed:\n{log[-8000:]}"
    return torch.load(out / "result.pt", weights_only=False)


def results_metrics(step: dict) -> dict[str, list[float]]:
    """verl's actor metrics that are results (``perf/*``: memory and MFU measurements of the process)."""
    return {k: v for k, v in step["metrics"].items() if "perf/" not in k}


def differences(a: dict, b: dict) -> dict[str, float]:
    """Largest absolute difference per quantity between two runs (every step, every parameter)."""
    out = {}
    for i, (sa, sb) in enumerate(zip(a["steps"], b["steps"])):
        for key in ("old_log_probs", "ref_log_prob", "advantages"):
            out[f"step{i}/{key}"] = (sa[key] - sb[key]).abs().max().item()
        ma, mb = results_metrics(sa), results_metrics(sb)
        assert ma.keys() == mb.keys()
        for k in ma:
            assert len(ma[k]) == len(mb[k]), k
            out[f"step{i}/{k}"] = max(abs(x - y) / (1 + abs(x)) for x, y in zip(ma[k], mb[k]))
    out["weights"] = max((a["weights"][n] - b["weights"][n]).abs().max().item() for n in a["weights"])
    return out


def test_engines_selected_by_external_lib(runs):
    assert runs["stock"]["engine"] == "FSDPEngineWithLMHead"
    assert runs["flexgroup"]["engine"] == "FlexGroupFSDPEngine"
    assert runs["broken"]["engine"] == "PreviousRowEngine"


def test_two_grpo_steps_match_stock(runs):
    stock, flex = runs["stock"], runs["flexgroup"]
    assert len(stock["steps"]) == 2
    diff = differences(stock, flex)
    for key, d in diff.items():
        tol = WEIGHT_TOL if key == "weights" else LOGP_TOL if "log_prob" in key else METRIC_TOL
        assert d <= tol, f"{key}: flexgroup differs from verl's stock engine by {d:.3g} > {tol}"
    # the run trains and the metrics are not trivial
    moved = max((stock["weights"][n] - stock["start"][n]).abs().max().item() for n in stock["weights"])
    assert moved > 100 * WEIGHT_TOL
    for step in stock["steps"]:
        m = results_metrics(step)
        assert {"actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/grad_norm", "actor/loss"} <= m.keys()
        assert all(abs(x) > 0 for x in m["actor/grad_norm"]) and all(abs(x) > 0 for x in m["actor/pg_loss"])
        assert step["advantages"].abs().max() > 0.1


def test_flexgroup_shared_prefixes(runs):
    stats = runs["flexgroup"]["stats"]
    assert stats["fallback_micro_batches"] == 0
    assert stats["grouped_tokens"] < 0.8 * stats["real_tokens"], stats


def test_broken_engine_is_caught(runs):
    diff = differences(runs["stock"], runs["broken"])
    assert diff["step0/old_log_probs"] > 0.05 and diff["step1/ref_log_prob"] > 0.05
    assert diff["weights"] > 100 * WEIGHT_TOL
    assert diff["step0/actor/grad_norm"] > 100 * METRIC_TOL and diff["step0/actor/pg_loss"] > 100 * METRIC_TOL



def _first_epoch(run: dict) -> list[dict]:
    """verl's ppo_loss calls before the first optimizer step: 2 steps x 2 epochs x micro-batches, step 0's first epoch."""
    calls = run["loss_inputs"]
    per_epoch = len(calls) // (2 * 2)
    assert per_epoch >= 2 and len(calls) == 4 * per_epoch
    return calls[:per_epoch]


def _ratio_gaps(calls: list[dict]) -> list[float]:
    """Per micro-batch, max |log_prob - old_log_prob| over its response tokens (0.0: torch.equal)."""
    return [(c["log_prob"] - c["old_log_prob"])[c["mask"].bool()].abs().max().item() for c in calls]


def test_first_update_pass_reproduces_the_old_log_probs_bitwise(runs):
    """Issue 43: before the first optimizer step the update's forward sees the old-log-prob pass's weights, so
    the ratio must be exactly 1. verl's stock engine (each sequence alone) gives torch.equal log-probs; so does
    flexgroup, in every micro-batch -- though the old-log-prob pass packs the whole batch into one trie, where
    the system prefix that prompts 0 and 1 share is a segment of its own, and an update micro-batch of 2 samples
    splits groups and keeps that prefix inside one prompt segment (the lse backend's grid plan,
    docs/batch-invariance.md)."""
    assert _ratio_gaps(_first_epoch(runs["stock"])) == [0.0] * 6
    assert _ratio_gaps(_first_epoch(runs["flexgroup"])) == [0.0] * 6
    # the second epoch follows an update: the ratio moves (the recording is not of one tensor twice)
    assert min(_ratio_gaps(runs["flexgroup"]["loss_inputs"][6:12])) > 1e-5


def test_dynamic_batch_sizes_match_stock(runs):
    """flexgroup with dynamic batch sizes (passes packed by 80 and 130 tokens) against the stock engine (fixed
    micro-batches of 2): the same log-probs and weights; the first update's ratio is exactly 1."""
    stock, dyn = runs["stock"], runs["flexgroup_dynamic"]   # (other micro-batch counts: per-micro-batch metrics differ)
    for i, (a, b) in enumerate(zip(stock["steps"], dyn["steps"])):
        for key in ("old_log_probs", "ref_log_prob", "advantages"):
            d = (a[key] - b[key]).abs().max().item()
            assert d <= LOGP_TOL, f"step {i} {key}: {d:.3g} > {LOGP_TOL}"
    d = max((stock["weights"][n] - dyn["weights"][n]).abs().max().item() for n in stock["weights"])
    assert d <= WEIGHT_TOL, f"weights after two steps: {d:.3g} > {WEIGHT_TOL}"
    assert set(_ratio_gaps(_first_epoch(runs["flexgroup_dynamic"]))) == {0.0}
