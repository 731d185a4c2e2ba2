"""flexgroup.verify: passes on every built-in architecture, fails on a wrong attention, leaves the model alone."""

import importlib

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.models.zoo import ARCHS, build_model, unavailable
from flexgroup.verification.equivalence import VerifyReport, verify


def groups_batch(vocab: int = 128, seed: int = 0) -> GroupedBatch:
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=g)

    # prompt longer than the tiny window (8), one shorter; responses of very different lengths
    return GroupedBatch.from_groups([ids(20), ids(5)], [[ids(7), ids(1), ids(13)], [ids(4), ids(9)]])




@pytest.mark.parametrize("arch", ARCHS)
def test_verify_passes_on_every_builtin_architecture_float32(arch):
    if unavailable(arch):
        pytest.skip(unavailable(arch))
    report = verify(build_model(arch), groups_batch())
    assert report.ok, report.table()
    assert report["logprobs"].max_abs <= 1e-5 and report["grads"].max_rel <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_verify_passes_in_float64_with_tight_differences(arch):
    report = verify(build_model(arch), groups_batch(), dtype=torch.float64)
    assert report.ok, report.table()
    assert report.dtype == torch.float64
    assert report["logprobs"].max_abs < 1e-6


def tree_batch(vocab: int = 128, seed: int = 1) -> GroupedBatch:
    """Multi-turn trajectories: a system prompt shared by two tasks, a branch mid-turn, a strict prefix,
    and loss masks that skip the tool/user tokens."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=g)

    system, task_a, task_b, turn = ids(9), ids(4), ids(6), ids(5)
    seqs = [torch.cat([system, task_a, turn, ids(3)]), torch.cat([system, task_a, turn, ids(7)]),
            torch.cat([system, task_a, turn]), torch.cat([system, task_b, ids(8)])]
    masks = [torch.arange(len(s)) >= 13 for s in seqs]
    masks[3] = torch.arange(len(seqs[3])) >= 15
    return GroupedBatch.from_sequences(seqs, masks)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_verify_handles_tree_batches_with_loss_masks(arch):
    batch = tree_batch()
    assert batch.num_tokens < sum(len(p) for p in batch.paths)  # prefixes really are shared
    report = verify(build_model(arch), batch)
    assert report.ok, report.table()
    assert report["logprobs"].max_abs <= 1e-5 and report["grads"].max_rel <= 1e-4


def test_verify_catches_a_leak_in_a_tree_batch(causal_over_packed_row):
    report = verify(build_model("llama"), tree_batch())
    assert not report.ok and not report["logprobs"].ok


def test_verify_catches_responses_that_attend_to_their_siblings(causal_over_packed_row):
    report = verify(build_model("llama"), groups_batch())
    assert not report.ok
    assert report["logits"].max_abs > 1e-2 and report["grads"].max_rel > 1e-2
    assert "equivalent: no" in report.table()


def test_verify_leaves_the_callers_model_untouched():
    model = build_model("qwen2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    impl = model.config._attn_implementation
    verify(model, groups_batch())
    assert model.config._attn_implementation == impl
    assert not flexgroup.patches.is_patched(model)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_verify_accepts_an_already_patched_model_and_unpatches_its_baseline_copy():
    model = flexgroup.patch(build_model("mistral"))
    report = verify(model, groups_batch())
    assert report.ok, report.table()
    assert report.baseline_attention == "sdpa"
    assert flexgroup.patches.is_patched(model)


def test_verify_matches_responses_given_out_of_group_order_through_from_padded():
    # rows 0 and 2 share prompt A, rows 1 and 3 prompt B (interleaved ids); prompts left-padded
    a, b = torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([11, 12, 13])
    prompt_ids = torch.zeros(4, 6, dtype=torch.long)
    prompt_mask = torch.zeros(4, 6, dtype=torch.long)
    for i, p in enumerate([a, b, a, b]):
        prompt_ids[i, 6 - len(p):], prompt_mask[i, 6 - len(p):] = p, 1
    lens = [3, 6, 1, 4]
    completion_ids = torch.randint(0, 128, (4, 6), generator=torch.Generator().manual_seed(1))
    completion_mask = (torch.arange(6)[None] < torch.tensor(lens)[:, None]).long()
    batch = GroupedBatch.from_padded(prompt_ids, prompt_mask, completion_ids, completion_mask,
                                     group_ids=[0, 1, 0, 1])
    report = verify(build_model("llama"), batch)
    assert report.ok, report.table()


def test_tolerance_overrides_apply():
    report = verify(build_model("llama"), groups_batch(), tol={"grads": 0.0}, calibration="none")
    assert not report.ok and not report["grads"].ok and report["logprobs"].ok
    assert report.reference is None and report["grads"].calibrated is None and "vs float64" not in report.table()


# ------------------------------------------------------------------ calibrated verdict (float64 reference)


def test_calibrated_verdict_passes_rounding_that_a_fixed_tolerance_would_fail():
    # a 6-layer model against tolerances no float32 run can meet: the verdict rests on the float64
    # truth -- flexgroup's float32 error within a small factor of the stock float32 run's own
    report = verify(build_model("llama", num_hidden_layers=6), groups_batch(),
                    tol={"logits": 1e-12, "logprobs": 1e-12, "grads": 1e-12})
    assert report.ok, report.table()
    assert report.reference == "float64"
    for d in report.differences:
        assert not d.within_tol and d.calibrated
        assert 0 < d.flex_error <= d.factor * d.stock_error < 1e-4
    table = report.table()
    assert "vs float64:" in table and f"{report['logprobs'].stock_error:.2e}" in table


def test_calibrated_verdict_still_fails_a_leaky_mask_on_a_deep_model(causal_over_packed_row):
    report = verify(build_model("llama", num_hidden_layers=6), groups_batch())
    assert not report.ok and "equivalent: no" in report.table()
    for d in report.differences:
        assert not d.calibrated and d.flex_error > 100 * d.stock_error


def test_calibration_choice_is_validated_and_float64_runs_need_none():
    with pytest.raises(ValueError, match="calibration='float32'"):
        verify(build_model("llama"), groups_batch(), calibration="float32")
    assert verify(build_model("llama", num_hidden_layers=1), groups_batch(), dtype=torch.float64).reference is None


def test_token_ids_beyond_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="token id 200"):
        verify(build_model("llama"), GroupedBatch.from_groups([torch.tensor([200, 1])], [[torch.tensor([3])]]))


def test_flexgroup_verify_is_callable_after_importing_the_submodule():
    importlib.import_module("flexgroup.verification.equivalence")
    assert isinstance(flexgroup.verify(build_model("llama", num_hidden_layers=1), groups_batch()), VerifyReport)


@pytest.mark.parametrize("kwargs, message", [
    (dict(float64_bytes=-5), r"float64_bytes=-5: give the largest float64 copy in bytes, an int >= 0"),
    (dict(float64_bytes=1.5e9), r"float64_bytes=1500000000.0"),
    (dict(float64_bytes=True), r"float64_bytes=True"),
    (dict(tol={"logprob": 1e-3}), r"unknown key 'logprob'"),
    (dict(tol={"grads": -1e-3}), r"tol\['grads'\]=-0.001: a tolerance is a finite number >= 0"),
    (dict(tol={"logits": float("nan")}), r"tol\['logits'\]=nan"),
])
def test_nonsense_limits_and_tolerances_are_refused_naming_the_value(kwargs, message):
    """Issue 38 item 10: a negative or non-integer byte limit, an unknown or negative tolerance were accepted."""
    with pytest.raises(ValueError, match=message):
        verify(build_model("llama"), groups_batch(), **kwargs)
