"""flexgroup's verl engine streams a prefix trie bigger than verl's per-GPU token budget (issue 29).

The oracle is verl's STOCK ``FSDPEngineWithLMHead`` fed the same batch through its own
``forward_backward_batch`` and ``ppo_loss`` (KL loss on); both run in ``tests/integrations/_verl_stream_harness.py``:
GRPO groups with 60-token prompts whose tries (~150 grouped tokens) exceed a dynamic-bsz budget of 128
tokens, beside a small group that fits. Compared: every log-prob (and entropy in the forward-only pass)
verl returns, the micro-batch losses and metrics, every full parameter gradient; float64 and float32.

- 1 gloo rank: the tries stream (:mod:`flexgroup.integrations.verl_stream`); per-trie temperatures; the
  old-log-prob pass with entropies; the refusals (temperatures within a trie, training-pass entropy, a budget
  below 128) cut the trie exactly with one warning; a Gated DeltaNet hybrid (Qwen3.5's text model) streamed;
  a Mamba2 hybrid that ``flexgroup.patch`` refuses (falcon_h1 on transformers 5.10) runs verl's stock step.
- 2 gloo ranks: Ulysses over both (one replica) streams sharded; 2 data-parallel replicas refuse (cut, one
  warning); the hybrid under Ulysses is refused at build, naming the fix.

Skipped where verl is not installed (the main suite's environment); CI runs it in ``.ci/verl``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl", minversion="0.9", reason="verl 0.9 is not installed (pip install 'flexgroup[verl]')")

sys.path.insert(0, str(Path(__file__).parent))
from test_verl import _assert_same_grads, _assert_same_metrics, _assert_same_outputs, run_harness  # noqa: E402

HARNESS = Path(__file__).with_name("_verl_stream_harness.py")
WORLDS = (1, 2)
TOL = {"fp64": (1e-12, 1e-10), "fp32": (5e-6, 2e-5)}  # (log-prob / entropy / loss abs, gradient rel to max)
STREAMED = {1: ["stream-train-fp64", "stream-train-fp32", "stream-checkpointing-train-fp32", "stream-old-log-prob-fp32",
                "stream-temperature-per-trie-fp32"],
            2: ["sp2-stream-train-fp64", "sp2-stream-train-fp32", "sp2-stream-old-log-prob-fp32"]}
REFUSED = [(1, "stream-temperature-within-trie-fp32", "different temperatures"),
           (1, "stream-train-entropy-fp32", "entropy in the training pass"),
           (1, "stream-small-budget-fp32", "below one streamed block (128 tokens"),
           (2, "dp2-stream-refused-fp32", "2 data-parallel replicas")]


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> dict[int, list[dict]]:
    """Per world size, per rank: {case: {engine: result}} (both sizes run at once)."""
    return run_harness(HARNESS, tmp_path_factory, "verl_stream", WORLDS)


def _tol(case: str) -> tuple[float, float]:
    return TOL["fp64" if "fp64" in case else "fp32"]


def _assert_exact(flex: dict, stock: dict, case: str, what: str) -> None:
    atol, rel = _tol(case)
    _assert_same_outputs(flex, stock, atol, what)
    _assert_same_metrics(flex, stock, atol, what)
    if stock["grads"] is not None:
        assert len(stock["grads"]) == 27  # every parameter of the tiny Qwen2
        _assert_same_grads(flex["grads"], stock["grads"], rel, what)


@pytest.mark.parametrize("world, case", [(w, c) for w in WORLDS for c in STREAMED[w]])
def test_a_trie_over_the_budget_streams_and_equals_verls_stock_engine(harness, world, case):
    for r, res in enumerate(harness[world]):
        flex, stock = res[case]["flexgroup"], res[case]["stock"]
        assert flex["warnings"] == []
        st = flex["stats"]
        assert st["streamed_tries"] == 2 and 2 <= st["streamed_forwards"] < st["forwards"]
        _assert_exact(flex, stock, case, f"{case} rank {r}")


def test_a_mini_batch_of_tries_over_the_budget_only_streams_exactly(harness):
    # no planned forward: the last stream runs with FSDP's gradient sync on
    res = harness[1][0]["stream-only-train-fp64"]
    flex, stock = res["flexgroup"], res["stock"]
    assert flex["warnings"] == [] and flex["stats"]["streamed_tries"] == 2
    assert flex["stats"]["streamed_forwards"] == flex["stats"]["forwards"]
    _assert_exact(flex, stock, "stream-only-train-fp64", "streams only")


def test_streaming_encodes_the_shared_prefix_once(harness):
    res = harness[1][0]
    streamed, cut = res["stream-train-fp32"]["flexgroup"], res["stream-temperature-within-trie-fp32"]["flexgroup"]
    # an independent count (token ids entering the embedding) agrees with the engine's counter
    assert streamed["embedded_tokens"] == streamed["stats"]["grouped_tokens"]
    # the same rows cut (one trie's prompt re-encoded per forward) and through verl's stock step
    stock = res["stream-train-fp32"]["stock"]
    assert streamed["stats"]["grouped_tokens"] < cut["stats"]["grouped_tokens"] < stock["embedded_tokens"]
    # under Ulysses each rank embeds its shard of the same streamed forwards
    sp = harness[2][0]["sp2-stream-train-fp32"]["flexgroup"]
    assert sp["stats"]["grouped_tokens"] == streamed["stats"]["grouped_tokens"]
    assert sp["embedded_tokens"] < streamed["embedded_tokens"]


@pytest.mark.parametrize("world, case, named", REFUSED)
def test_a_refused_stream_cuts_the_trie_exactly_with_one_warning(harness, world, case, named):
    for r, res in enumerate(harness[world]):
        flex, stock = res[case]["flexgroup"], res[case]["stock"]
        assert flex["stats"]["streamed_tries"] == 0
        assert len(flex["warnings"]) == 1 and named in flex["warnings"][0], flex["warnings"]
        assert "exceeds the per-GPU token budget" in flex["warnings"][0] and "re-encoded" in flex["warnings"][0]
        _assert_exact(flex, stock, case, f"{case} rank {r}")


@pytest.mark.parametrize("world, case", [(1, "stream-train-fp32"), (2, "sp2-stream-train-fp32")])
def test_a_broken_stream_read_back_is_caught(harness, world, case):
    # each sample's log-probs read one stream position early: the comparisons above must fail on it
    for res in harness[world]:
        broken, stock = res[case]["broken"], res[case]["stock"]
        assert broken["stats"]["streamed_tries"] == 2
        with pytest.raises(AssertionError, match="log_probs differs"):
            _assert_same_outputs(broken, stock, _tol(case)[0], case)
        with pytest.raises(AssertionError, match="gradient differs"):
            _assert_same_grads(broken["grads"], stock["grads"], _tol(case)[1], case)


def test_a_gated_deltanet_hybrid_streams_exactly(harness):
    # oracle: verl's stock step with each sample alone in its micro-batch (packed, transformers 5.10's Gated
    # DeltaNet carries its state from one sample into the next on CPU); verl's last entry of each sample
    # scores the next sample of its micro-batch, so it is left out; losses compared summed
    res = harness[1][0]["hybrid-stream-train-fp64"]
    flex, stock = res["flexgroup"], res["stock"]
    assert flex["warnings"] == [] and flex["stats"]["streamed_tries"] == 2
    assert torch.equal(flex["offsets"], stock["offsets"])
    keep = torch.ones_like(flex["log_probs"], dtype=torch.bool)
    keep[flex["offsets"][1:] - 1] = False
    assert (flex["log_probs"][keep] - stock["log_probs"][keep]).abs().max() <= 1e-12
    assert abs(flex["loss"].sum() - stock["loss"].sum()) <= 1e-12
    assert len(stock["grads"]) == 28  # every parameter of the tiny Qwen3.5 text model
    _assert_same_grads(flex["grads"], stock["grads"], 1e-10, "hybrid streamed")


def test_a_hybrid_under_ulysses_is_refused_at_build_naming_the_fix(harness):
    for res in harness[2]:
        msg = res["hybrid-sp2"]
        assert msg is not None and "ulysses_sequence_parallel_size=2" in msg and "transformers>=5.24" in msg
        assert "ulysses_sequence_parallel_size=1" in msg and "unregister" in msg


def test_an_architecture_patch_refuses_runs_verls_stock_step_with_one_warning(harness):
    res = harness[1][0]["refused-arch-train-fp32"]
    flex, stock = res["flexgroup"], res["stock"]
    assert len(flex["warnings"]) == 1 and "flexgroup.patch refuses" in flex["warnings"][0]
    assert "falcon_h1" in flex["warnings"][0]
    assert flex["stats"]["fallback_micro_batches"] == 3 and flex["stats"]["grouped_tokens"] == 0
    _assert_same_outputs(flex, stock, 0.0, "refused architecture")
    _assert_same_grads(flex["grads"], stock["grads"], 0.0, "refused architecture")


# ------------------------------------------------------------------------------------------ no processes
def test_which_tries_stream():
    from flexgroup.integrations.verl_stream import streamed_tries

    prompt = list(range(100, 160))
    group = [prompt + [k] * 20 for k in range(1, 5)]                 # 60 + 4 x 20 = 140 grouped tokens
    small = [[7, 8, 9, k] for k in range(4)]
    assert streamed_tries(group + small, 128) == [([0, 1, 2, 3], 60, 2)]
    assert streamed_tries(group + small, 256) == []                  # it fits: planned as one forward
    # a token every sample shares (BOS) is not worth a stream of everything; the prompt's trie is
    bos = [[1] + s for s in group + small]
    assert streamed_tries(bos, 128) == [([0, 1, 2, 3], 61, 2)]
    # a short prefix (2 of ~110 tokens per forward) re-encoded: cut, not streamed
    assert streamed_tries([[5, 6] + list(range(200 + 50 * k, 250 + 50 * k)) for k in range(4)], 128) == []


@pytest.mark.parametrize("change, named", [
    ({"strategy": "fsdp"}, "FSDP1"), ({"scaler": object()}, "gradient scaler"),
    ({"calculate_sum_pi_squared": True}, "calculate_sum_pi_squared"), ({"dp": 4}, "4 data-parallel replicas")])
def test_every_refusal_is_named(change, named):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from flexgroup.integrations.verl_stream import stream_refusal

    engine = SimpleNamespace(get_data_parallel_size=lambda: change.get("dp", 1), scaler=change.get("scaler"),
                             engine_config=SimpleNamespace(strategy=change.get("strategy", "fsdp2")))
    data = TensorDict({"input_ids": torch.zeros(2, 3)}, batch_size=[2])
    tu.assign_non_tensor(data, calculate_sum_pi_squared=change.get("calculate_sum_pi_squared", False))
    refusal = stream_refusal(engine, data, 128, forward_only=False)
    assert refusal is not None and named in refusal[1]
    plain = SimpleNamespace(get_data_parallel_size=lambda: 1, scaler=None,
                            engine_config=SimpleNamespace(strategy="fsdp2"))
    assert stream_refusal(plain, TensorDict({"input_ids": torch.zeros(2, 3)}, batch_size=[2]), 128, False) is None
