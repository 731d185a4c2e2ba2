"""A batch remembers which kinds of forward it made inputs for (``model_inputs()`` / ``model_inputs(shard=group)``),
so that logits are never read as the other kind: a rank's slice read without ``shard=`` (or an unsharded forward's
logits read with it) is refused, naming ``shard=``, where the row count would otherwise have been accepted and read
at the wrong rows. In one process, ranks simulated by patching ``group_rank_world``; the same refusal on two gloo
ranks with a real model is in tests/patches/test_sequence_parallel.py (``test_loud_where_it_cannot_be_exact``)."""

from __future__ import annotations

import pytest
import torch

from flexgroup import GroupedBatch
from flexgroup.data import sharding

V = 23


def _batch():
    """Prompt 6, responses 4 and 4: L = 14 tokens, K = 7 needed logit rows, and on 2 ranks c = 7 rows each --
    a rank's slice has exactly the needed-only row count of the whole batch."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, V, (6,), generator=g)
    responses = [torch.randint(1, V, (4,), generator=g) for _ in range(2)]
    batch = GroupedBatch.from_groups([prompt], [responses])
    assert (batch.num_tokens, batch.logit_rows.numel()) == (14, 7)
    return batch, prompt, responses


def _truth(logits: torch.Tensor, batch: GroupedBatch, prompt, responses) -> torch.Tensor:
    """Each sequence on its own: log_softmax of the row that predicts each response token (float64)."""
    out = torch.zeros(2, 4, dtype=torch.float64)
    for i, r in enumerate(responses):
        seq_rows = batch.paths[i]                                     # packed index of each token of [P; R_i]
        for t in range(len(r)):
            row = seq_rows[len(prompt) - 1 + t]
            out[i, t] = torch.log_softmax(logits[row], -1)[r[t]]
    return out


def _as_rank(monkeypatch, r, world=2):
    monkeypatch.setattr(sharding, "group_rank_world", lambda group, arg="shard=": (r, world))


def test_a_ranks_slice_read_without_shard_is_refused_and_with_it_is_exact(monkeypatch):
    batch, prompt, responses = _batch()
    logits = torch.randn(batch.num_tokens, V, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    truth = _truth(logits, batch, prompt, responses)
    total = torch.zeros_like(truth)
    for r in range(2):
        _as_rank(monkeypatch, r)
        batch, *_ = _batch()                                          # each rank's process builds its own
        inputs = batch.model_inputs(shard=object())
        local = logits[r * 7:(r + 1) * 7][None]                      # what this rank's forward returns
        assert inputs["input_ids"].shape[1] == local.shape[1] == 7
        with pytest.raises(ValueError, match=r"wrong log-probs: pass the group given to model_inputs: batch\.logprobs\(logits, shard=group\)"):
            batch.logprobs(local)
        total += batch.logprobs(local, shard=object())
    assert (total - truth).abs().max() < 1e-12
    # what the refused read would have returned: the slice taken for needed-only rows, far from the truth
    pred, tgt, flat = batch.read_index(torch.device("cpu"), needed_only=True)
    wrong = torch.zeros(2 * 4, dtype=torch.float64).index_put((flat,), torch.log_softmax(
        logits[:7][pred], -1).gather(1, tgt[:, None])[:, 0]).view(2, 4)
    assert (wrong - truth).abs().max() > 0.1


def test_other_row_counts_name_shard_too(monkeypatch):
    batch, *_ = _batch()
    _as_rank(monkeypatch, 0)
    batch.model_inputs(shard=object())
    for n in (5, 9):
        with pytest.raises(ValueError, match=r"shard=group"):
            batch.logprobs(torch.randn(1, n, V))


def test_unsharded_logits_read_with_shard_are_refused(monkeypatch):
    """model_inputs(needed_logits_only=True) without shard= gives [1, 7, V]: read with shard= on rank 0 of 2 it
    would pass as that rank's slice of 7 rows."""
    batch, prompt, responses = _batch()
    batch.model_inputs(needed_logits_only=True)
    _as_rank(monkeypatch, 0)
    logits = torch.randn(1, 7, V)
    with pytest.raises(ValueError, match=r"made with model_inputs\(\) \(unsharded\).*shard= given to model_inputs"):
        batch.logprobs(logits, shard=object())
    # without shard= the same logits are the needed rows of the whole batch, read exactly
    full = torch.zeros(batch.num_tokens, V, dtype=torch.float64)
    full[batch.logit_rows] = logits[0].double()
    assert (batch.logprobs(logits.double()) - _truth(full, batch, prompt, responses)).abs().max() < 1e-12


def test_a_batch_used_for_both_kinds_refuses_only_ambiguous_row_counts(monkeypatch):
    batch, prompt, responses = _batch()
    _as_rank(monkeypatch, 1)
    batch.model_inputs(shard=object())
    batch.model_inputs()
    logits = torch.randn(batch.num_tokens, V, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    # 14 rows can only be the whole row: read exactly
    assert (batch.logprobs(logits[None]) - _truth(logits, batch, prompt, responses)).abs().max() < 1e-12
    # 7 rows fit both rank 1's slice and the needed rows of the whole batch: refused either way
    with pytest.raises(ValueError, match="rank 1 of 2 gives"):
        batch.logprobs(logits[7:][None])
    with pytest.raises(ValueError, match=r"model_inputs\(\) \(unsharded\) gives"):
        batch.logprobs(logits[7:][None], shard=object())


def test_a_batch_never_given_to_model_inputs_reads_either_kind(monkeypatch):
    """Nothing recorded: the row count alone decides (as before), e.g. logits computed by other code."""
    batch, prompt, responses = _batch()
    logits = torch.randn(batch.num_tokens, V, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    truth = _truth(logits, batch, prompt, responses)
    assert (batch.logprobs(logits[batch.logit_rows][None]) - truth).abs().max() < 1e-12
    total = 0
    for r in range(2):
        _as_rank(monkeypatch, r)
        total = total + batch.logprobs(logits[r * 7:(r + 1) * 7][None], shard=object())
    assert (total - truth).abs().max() < 1e-12


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_the_batch_remembers_the_sharded_inputs_and_refuses_the_unsharded_read(monkeypatch, how):
    """Issue 38 item 6: ``copy.deepcopy(batch).logprobs(rank_logits)`` read a rank's 7 rows as the whole row's 7
    needed rows (a per-process memory keyed by the original batch); the memory is the batch's own now."""
    import copy
    import pickle

    _as_rank(monkeypatch, 0)
    batch, *_ = _batch()
    batch.model_inputs(shard=object())
    twin = copy.deepcopy(batch) if how == "deepcopy" else pickle.loads(pickle.dumps(batch))
    local = torch.randn(1, 7, V, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"batch\.logprobs\(logits, shard=group\)"):
        twin.logprobs(local)
    assert torch.equal(twin.logprobs(local, shard=object()), batch.logprobs(local, shard=object()))
