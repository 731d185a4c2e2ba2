"""TRL adapters in 2 processes (gloo, CPU; accelerate's MULTI_CPU, the Trainer wraps the policy in DDP).

Oracle: the stock TRL trainer (``GRPOTrainer`` / ``DPOTrainer``) in the same 2-process setup, same seed,
same replayed completions (``_trl_dist.py`` runs every case in one spawn of 2 ranks). Compared on each
rank and each of 2 optimizer steps: the loss, the KL TRL logs, every parameter gradient after the
backward (DDP's all-reduce, or the adapter's own average in budget mode), and every weight after the 2
steps; float32. The gradients are also equal between the two ranks (the ranks hold different rows, so
this shows they were averaged).

- ``grpo_flex`` / ``dpo_flex``: the adapters under DDP; ``fsdp_*``: the same under FSDP2 (the Trainer's
  ``fsdp_config={"version": 2}``; accelerate enables its FSDP plugin only on accelerator devices, so the
  harness sets its state to FSDP on CPU as it does there).
- ``grpo_budget``: ``flexgroup_budget=128`` with 130-190-token prompts (every chunk streamed): the
  policy's forwards bypass DDP's reducer and the adapter averages the gradients itself. Broken on
  purpose (``grpo_budget_unreduced``): without that average the comparison fails.
- ``grpo_split_*``: ``num_generations=4``, 6 rows per process: TRL's RepeatSampler puts 2 rows of one
  group on each process. Kept as TRL placed it (exact), counted in ``trainer.flexgroup_groups`` and
  said once in a warning.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from _gloo import run_harness  # noqa: E402
from _trainers import save_tiny_llama  # noqa: E402

HARNESS = Path(__file__).with_name("_trl_dist.py")
FUSED_DPO = hasattr(sys.modules[trl.DPOTrainer.__module__], "add_fused_lm_head")
GRPO = ["grpo_stock", "grpo_flex", "grpo_budget", "grpo_budget_unreduced", "grpo_accum_stock", "grpo_accum_budget",
        "grpo_split_stock", "grpo_split_flex"]
DPO = ["dpo_stock", "dpo_flex"]


def _spawn(out: Path, cases: list[str], harness: Path = HARNESS) -> dict:
    """Every case in one harness run (``tests/_gloo.spawn_ranks``: a failed or hung rank stops all, with its
    traceback or stack; the harness process itself is given ``SUBPROCESS_TIMEOUT`` = 360 s)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    run_harness([str(harness), str(out), *cases], env=env)
    return {c: [torch.load(out / f"{c}.rank{r}.pt", weights_only=False) for r in range(2)] for c in cases}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("trl_dist")
    save_tiny_llama(out / "model", max_positions=512)
    save_tiny_llama(out / "ref", max_positions=512, seed=1)
    return out


def _fsdp2_on_cpu() -> str | None:
    """None when this torch runs FSDP2 on CPU, else why not."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401  (torch >= 2.6)
    except ImportError:
        return "this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)"
    if not hasattr(torch.cpu.current_stream(), "record_event"):
        return "this torch's FSDP2 cannot run on CPU (torch.cpu.Stream.record_event is missing, e.g. torch 2.6)"
    import transformers

    if not hasattr(transformers.TrainingArguments, "_process_fsdp_args"):
        return ("this transformers (e.g. 4.56) configures FSDP through environment variables (FSDP1, "
                "sync_module_states=True, which accelerate refuses on CPU), not fsdp_config={'version': 2}")
    return None


@pytest.fixture(scope="module")
def runs(models):
    """Every case in one spawn of 2 processes (the FSDP2 ones last: they switch accelerate's state)."""
    dpo = DPO if FUSED_DPO else []
    fsdp = [] if _fsdp2_on_cpu() else [f"fsdp_{c}" for c in ["grpo_stock", "grpo_flex"] + dpo]
    return _spawn(models, ["average"] + GRPO + dpo + fsdp)


def _assert_same_run(got: dict, ref: dict, grad_rel: float = 1e-4, weight_atol: float = 2e-5) -> None:
    """One rank's 2 steps: loss, KL, every gradient, final weights (float32 noise floor)."""
    assert len(got["steps"]) == len(ref["steps"]) == 2
    for s, (a, b) in enumerate(zip(got["steps"], ref["steps"])):
        torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-5, atol=1e-6)
        if "kl" in b["metrics"]:
            assert a["metrics"]["kl"] == pytest.approx(b["metrics"]["kl"], rel=1e-4, abs=1e-9), f"step {s} kl"
        assert a["grads"].keys() == b["grads"].keys() and len(b["grads"]) > 0
        for name, gb in b["grads"].items():
            scale = gb.abs().max().item()
            err = (a["grads"][name] - gb).abs().max().item()
            assert scale > 0 and err <= grad_rel * scale, f"step {s} {name}: grad error {err:.3g}, scale {scale:.3g}"
    for name, w in ref["weights"].items():
        err = (got["weights"][name] - w).abs().max().item()
        assert err <= weight_atol, f"weight {name} after 2 steps differs by {err:.3g}"


def _assert_ranks_averaged(run: list[dict]) -> None:
    for s in range(2):
        g0, g1 = run[0]["steps"][s]["grads"], run[1]["steps"][s]["grads"]
        for name, g in g0.items():
            assert torch.equal(g, g1[name]), f"step {s} {name}: the ranks' gradients differ (not averaged)"


def _check(runs, case, stock, mode="MULTI_CPU", wrapped="DistributedDataParallel"):
    for r in range(2):
        assert runs[case][r]["distributed_type"] == f"DistributedType.{mode}"
        assert runs[case][r]["wrapped"] == wrapped
        _assert_same_run(runs[case][r], runs[stock][r])
    _assert_ranks_averaged(runs[case])
    _assert_ranks_averaged(runs[stock])
    assert runs[case][0]["steps"][0]["loss"] != runs[case][1]["steps"][0]["loss"]   # the ranks held different rows


@pytest.mark.slow
def test_grpo_adapter_under_ddp_equals_stock_trl_per_step(runs):
    _check(runs, "grpo_flex", "grpo_stock")
    for r in range(2):
        s = runs["grpo_flex"][r]["stats"]
        assert s["policy"]["grouped_tokens"] < s["policy"]["real_tokens"] and not s["policy"].get("fallback_tokens")
        # one generation (num_iterations=2): one reference and one old-policy pass, a policy pass per step
        assert (s["ref"]["forwards"], s["old"]["forwards"], s["policy"]["forwards"]) == (1, 1, 2)
        assert runs["grpo_flex"][r]["groups"]["split_groups"] == 0


@pytest.mark.slow
def test_dpo_adapter_under_ddp_equals_stock_trl_per_step(runs):
    if not FUSED_DPO:
        pytest.skip("this TRL's DPOTrainer has no fused LM head: flexgroup's DPO adapter does not cover it")
    _check(runs, "dpo_flex", "dpo_stock")
    for r in range(2):
        s = runs["dpo_flex"][r]["stats"]
        assert s["policy"]["forwards"] == 2 and s["policy"]["grouped_tokens"] < s["policy"]["real_tokens"]


@pytest.mark.slow
def test_streaming_budget_under_ddp_equals_stock_trl_per_step(runs):
    _check(runs, "grpo_budget", "grpo_stock")
    for r in range(2):
        s = runs["grpo_budget"][r]["stats"]
        assert s["policy"]["streamed_forwards"] == s["policy"]["forwards"] == 2 * s["policy"]["recomputed_forwards"] > 4
        for role in ("ref", "old"):
            assert s[role]["streamed_forwards"] == s[role]["forwards"] > 2, role


@pytest.mark.slow
def test_streaming_budget_under_ddp_averages_once_per_accumulation_window(runs):
    """2 micro-batches (one group each) per optimizer step: the gradients are averaged over the ranks when
    the window closes. The adapter's micro-batches hold other rows than stock TRL's (whole groups), so
    only window totals compare: the summed ``grpo`` losses, the gradients after the window, the weights."""
    for r in range(2):
        got, ref = runs["grpo_accum_budget"][r], runs["grpo_accum_stock"][r]
        assert len(got["steps"]) == len(ref["steps"]) == 4
        for w in (0, 1):
            a, b = got["steps"][2 * w: 2 * w + 2], ref["steps"][2 * w: 2 * w + 2]
            torch.testing.assert_close(sum(x["loss"] for x in a), sum(x["loss"] for x in b), rtol=1e-5, atol=1e-6)
            for name, gb in b[1]["grads"].items():
                scale = gb.abs().max().item()
                err = (a[1]["grads"][name] - gb).abs().max().item()
                assert scale > 0 and err <= 1e-4 * scale, f"window {w} {name}: grad error {err:.3g}, scale {scale:.3g}"
        for name, wt in ref["weights"].items():
            assert (got["weights"][name] - wt).abs().max().item() <= 2e-5, name
        assert got["stats"]["policy"]["streamed_forwards"] > 4
    for w in (1, 3):   # after each window: the same (averaged) gradients on both ranks
        g0, g1 = (runs["grpo_accum_budget"][r]["steps"][w]["grads"] for r in range(2))
        assert all(torch.equal(g, g1[n]) for n, g in g0.items())


def test_average_gradients_is_ddps_mean_over_the_ranks(runs):
    """Each gradient divided by the world size, then summed (as DDP's reducer); one present on rank 1 only
    counts as zero on rank 0; one absent everywhere stays None; frozen parameters are left alone."""
    r0, r1 = runs["average"]
    assert r0["count"] == r1["count"] == 3
    for name in ("a", "b"):
        want = r0["before"][name] / 2 + r1["before"][name] / 2
        assert want.dtype == r0["before"][name].dtype
        assert torch.equal(r0["after"][name], want) and torch.equal(r1["after"][name], want), name
    assert r0["before"]["c"] is None and torch.equal(r0["after"]["c"], r1["before"]["c"] / 2)
    assert torch.equal(r1["after"]["c"], r1["before"]["c"] / 2)
    assert r0["after"]["d"] is None and r1["after"]["d"] is None and r0["after"]["e"] is None


@pytest.mark.slow
def test_streaming_budget_without_the_gradient_average_is_caught(runs):
    broken = runs["grpo_budget_unreduced"]
    with pytest.raises(AssertionError, match="grad error"):
        _assert_same_run(broken[0], runs["grpo_stock"][0])
    with pytest.raises(AssertionError, match="not averaged"):
        _assert_ranks_averaged(broken)


@pytest.mark.slow
def test_groups_straddling_processes_stay_exact_and_are_reported(runs):
    _check(runs, "grpo_split_flex", "grpo_split_stock")
    tokens = []
    for r in range(2):
        run = runs["grpo_split_flex"][r]
        g = run["groups"]
        # each step: 6 rows here = one whole group of 4 + 2 rows of the group that straddles the ranks
        assert g["groups"] == 4 and g["split_groups"] == 2 and g["split_rows"] == 4 and g["split_prompt_tokens"] > 0
        assert sum("RepeatSampler spreads groups over processes" in w for w in run["warnings"]) == 1
        assert not any("micro-batches" in w for w in run["warnings"])     # one micro-batch per generation
        assert "split (4 rows here) across processes" in run["report"]
        tokens.append((run["stats"]["policy"]["grouped_tokens"], run["stats"]["policy"]["real_tokens"]))
    # whole groups on one process would encode each straddling prompt once instead of once per process
    whole = sum(t for t, _ in tokens) - runs["grpo_split_flex"][0]["groups"]["split_prompt_tokens"]
    print(f"\npolicy tokens per rank over 2 steps (grouped, real): {tokens}; whole groups per process: at most {whole}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grpo", "dpo"])
def test_adapters_under_fsdp2_equal_stock_trl_per_step(runs, kind):
    """FSDP2 (``fully_shard`` per decoder layer and on the model, reshard after forward): gradients are
    reduce-scattered; compared as full tensors on each rank."""
    if _fsdp2_on_cpu():
        pytest.skip(_fsdp2_on_cpu())
    if kind == "dpo" and not FUSED_DPO:
        pytest.skip("this TRL's DPOTrainer has no fused LM head: flexgroup's DPO adapter does not cover it")
    _check(runs, f"fsdp_{kind}_flex", f"fsdp_{kind}_stock", mode="FSDP", wrapped="FSDPLlamaForCausalLM")
    s = runs[f"fsdp_{kind}_flex"][0]["stats"]["policy"]
    assert s["forwards"] == 2 and s["grouped_tokens"] < s["real_tokens"] and not s.get("fallback_tokens")
