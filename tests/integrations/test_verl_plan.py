"""flexgroup.integrations.verl_plan: forwards planned by prefix trie, and verl's balance_batch by grouped cost.

The planner's counts are checked against flexgroup's own packed rows (``GroupedBatch.from_sequences``,
an independent trie builder) and by brute force; the trainer hook against verl's ``DataProto`` (skipped
where verl is not installed).
"""

from __future__ import annotations

import random

import pytest
import torch

from flexgroup import GroupedBatch
from flexgroup.integrations.verl_plan import (TOKEN_WEIGHT, group_balanced_partitions, grouped_tokens,
                                              grouped_workload, plan_forwards)


def _grpo(seed: int, groups: int = 6, n: int = 4, system: int = 5) -> list[list[int]]:
    """``groups`` prompts (sharing a ``system``-token prefix) x ``n`` responses; a duplicate response, a
    response that is a prefix of another."""
    rnd = random.Random(seed)
    sys_ = [rnd.randrange(3, 50) for _ in range(system)]
    seqs = []
    for _ in range(groups):
        p = sys_ + [rnd.randrange(3, 50) for _ in range(rnd.randrange(4, 30))]
        rs = [[rnd.randrange(3, 50) for _ in range(rnd.randrange(1, 20))] for _ in range(n)]
        rs[-1] = list(rs[0])                      # a duplicate
        rs[-2] = rs[1] + [7, 8]                    # sample 1 is a prefix of sample n-2
        seqs += [p + r for r in rs]
    return seqs


def test_grouped_counts_equal_flexgroups_packed_row():
    seqs = _grpo(0)
    batch = GroupedBatch.from_sequences([torch.tensor(s) for s in seqs])
    cost = batch.cost()
    assert grouped_tokens(seqs) == batch.num_tokens == cost.grouped_tokens
    assert grouped_workload(seqs) == TOKEN_WEIGHT * cost.grouped_tokens + 2 * cost.grouped_pairs
    assert grouped_tokens([[1, 2, 3]] * 4) == 3 and grouped_tokens([[1, 2], [1, 2, 3], [1, 4]]) == 4


@pytest.mark.parametrize("budget", [10_000, 300, 120, 60, 25])
def test_forwards_cover_every_sample_within_the_budget_and_keep_fitting_tries_whole(budget):
    seqs = _grpo(1)
    plan = plan_forwards(seqs, budget)
    assert sorted(i for f in plan.forwards for i in f) == list(range(len(seqs)))
    for f, c in zip(plan.forwards, plan.costs):
        assert c == grouped_tokens([seqs[i] for i in f])
        assert c <= budget or len({tuple(seqs[i]) for i in f}) == 1  # only one sequence may exceed it
    where = {i: j for j, f in enumerate(plan.forwards) for i in f}
    for g in range(6):  # a prompt's group whose trie fits the budget is never split
        members = range(4 * g, 4 * g + 4)
        if grouped_tokens([seqs[i] for i in members]) <= budget:
            assert len({where[i] for i in members}) == 1, f"group {g} split at budget {budget}"
    if budget >= grouped_tokens(seqs):
        assert len(plan.forwards) == 1 and plan.cuts == []
    else:
        assert plan.cuts and all(spanned > 1 for _, _, spanned in plan.cuts)


def test_min_forwards_splits_the_largest_forwards():
    seqs = _grpo(2)
    plan = plan_forwards(seqs, 10_000, min_forwards=5)
    assert len(plan.forwards) == 5 and sorted(i for f in plan.forwards for i in f) == list(range(len(seqs)))
    assert all(c == grouped_tokens([seqs[i] for i in f]) for f, c in zip(plan.forwards, plan.costs))
    with pytest.raises(ValueError, match="budget=0"):
        plan_forwards(seqs, 0)


def test_balance_keeps_groups_whole_and_balances_grouped_cost():
    rnd = random.Random(3)
    seqs, uids = [], []
    for g in range(8):  # prompts of very different lengths: raw-length balance and grouped balance disagree
        p = [rnd.randrange(3, 99) for _ in range(rnd.choice([10, 400]))]
        for _ in range(4):
            seqs.append(p + [rnd.randrange(3, 99) for _ in range(rnd.randrange(5, 60))])
            uids.append(f"u{g}")
    parts = group_balanced_partitions(seqs, uids, 2)
    assert sorted(i for p in parts for i in p) == list(range(32)) and [len(p) for p in parts] == [16, 16]
    for p in parts:
        assert p == sorted(p)  # batch order kept
        assert all(set(range(4 * (i // 4), 4 * (i // 4) + 4)) <= set(p) for i in p)  # whole groups
    loads = [grouped_workload([seqs[i] for i in p]) for p in parts]
    total = grouped_workload(seqs[:16]) + grouped_workload(seqs[16:])
    assert max(loads) - min(loads) <= max(grouped_workload(seqs[4 * g:4 * g + 4]) for g in range(8))
    assert sum(loads) == total or sum(loads) >= grouped_workload(seqs)  # each rank packs its own tries
    with pytest.raises(ValueError, match="3 uid groups"):
        group_balanced_partitions(seqs[:12], uids[:12], 2)


def test_verls_trainer_hook_reorders_the_batch_by_whole_groups():
    pytest.importorskip("verl", minversion="0.9", reason="verl 0.9 is not installed (pip install 'flexgroup[verl]')")
    import numpy as np
    from verl import DataProto

    from flexgroup.integrations import verl_plan

    seqs = _grpo(4, groups=4, n=4)
    width = max(map(len, seqs))
    ids, mask = torch.zeros(16, width, dtype=torch.long), torch.zeros(16, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):], mask[i, width - len(s):] = torch.tensor(s), 1
    order = [4 * g + k for k in range(4) for g in range(4)]  # rows interleaved: groups not contiguous
    uids = np.array([f"p{i // 4}" for i in order], dtype=object)
    batch = DataProto.from_dict({"input_ids": ids[order], "attention_mask": mask[order]}, non_tensors={"uid": uids})

    class Trainer:  # what the hook reads of verl's RayPPOTrainer (its module needs Ray's extras to import)
        config = type("C", (), {"actor_rollout_ref": type("A", (), {"actor": {"ppo_mini_batch_size": 16}})})()
        actor_rollout_wg = None
        verl_called = False

        def _get_dp_size(self, wg, role):
            return 2

        def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
            self.verl_called = True  # stands in for verl's own balancing

    stock = Trainer._balance_batch
    verl_plan.install_balance(Trainer)
    verl_plan.install_balance(Trainer)  # idempotent: verl's method stays the fallback
    installed = Trainer.__dict__["_balance_batch"]
    assert installed.func is verl_plan.balance_batch and installed.keywords == {"stock": stock}
    metrics = {}
    Trainer()._balance_batch(batch, metrics)
    got = list(batch.non_tensor_batch["uid"])
    ranks = [got[:8], got[8:]]
    assert all(len(set(r)) == 2 and all(r.count(u) == 4 for u in set(r)) for r in ranks)  # whole groups
    assert all(r[k] == r[k + 1] for r in ranks for k in (0, 1, 2, 4, 5, 6))  # each group contiguous
    for row, m, u in zip(batch.batch["input_ids"], batch.batch["attention_mask"], got):  # rows moved with their uid
        g = int(u[1:])
        assert row[m.bool()].tolist() in seqs[4 * g:4 * g + 4]
    assert "global_seqlen/grouped_tokens_max" in metrics and "global_seqlen/min" in metrics
    # without uids: verl's own balancing, one warning
    trainer = Trainer()
    with pytest.warns(UserWarning, match="no 'uid'"):
        trainer._balance_batch(DataProto.from_dict({"input_ids": ids.clone(), "attention_mask": mask.clone()}), {})
    assert trainer.verl_called
