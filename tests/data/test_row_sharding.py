"""The data side of sequence parallelism (flexgroup/data/sharding.py, ``GroupedBatch`` with ``shard=``), in one
process: the padded row and which rank reads which log-prob. The ranks themselves are tested with gloo in
tests/patches/test_sequence_parallel.py."""

from __future__ import annotations

import pytest
import torch

from flexgroup import GroupedBatch, Layout
from flexgroup.data import sharding


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_padding_is_a_separate_root_that_divides_the_row(world):
    lay = Layout.tree([-1, 0, 0, 1, -1], [5, 3, 4, 2, 3])
    padded = lay.padded(world)
    assert padded.num_tokens % world == 0 and padded.num_tokens - lay.num_tokens < world
    assert torch.equal(padded.position_ids[:lay.num_tokens], lay.position_ids)
    if padded is not lay:
        assert padded.parents[-1] == -1 and padded.parents[:-1] == lay.parents
        # no real token attends to padding, padding attends to nothing real
        dense = padded.dense_mask()
        assert not dense[:lay.num_tokens, lay.num_tokens:].any() and not dense[lay.num_tokens:, :lay.num_tokens].any()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_scored_token_is_read_by_exactly_one_rank(world, monkeypatch):
    g = torch.Generator().manual_seed(0)
    base = torch.randint(1, 50, (9,), generator=g)
    seqs = [torch.cat([base, torch.randint(1, 50, (n,), generator=g)]) for n in (4, 1, 6)] + [base[:5]]
    batch = GroupedBatch.from_sequences(seqs)
    logits = torch.randn(batch.num_tokens, 50, dtype=torch.float64, generator=g)
    whole = batch.logprobs(logits)
    padded = torch.cat([logits, torch.zeros(-batch.num_tokens % world, 50, dtype=torch.float64)])
    c = padded.shape[0] // world
    total = torch.zeros_like(whole)
    seen = torch.zeros_like(whole, dtype=torch.long)
    for r in range(world):
        monkeypatch.setattr(sharding, "group_rank_world", lambda group, r=r: (r, world))
        part = batch.logprobs(padded[r * c:(r + 1) * c][None], shard=object())
        total += part
        seen += part != 0
    assert torch.equal(total, whole)
    assert seen.max() <= 1 and torch.equal(seen.bool(), batch.response_mask)


def test_sharded_logprobs_refuse_logits_of_the_whole_row(monkeypatch):
    batch = GroupedBatch.from_groups([torch.arange(1, 8)], [[torch.arange(2, 5), torch.arange(3, 9)]])
    monkeypatch.setattr(sharding, "group_rank_world", lambda group: (0, 2))
    with pytest.raises(ValueError, match="this rank's slice"):
        batch.logprobs(torch.randn(1, batch.num_tokens, 11), shard=object())


@pytest.mark.parametrize("world", [2, 4])
def test_needed_rows_only_per_rank_including_ranks_with_none(world, monkeypatch):
    """A long prompt: the first ranks hold no row that predicts a response token ([1, 0, V] logits)."""
    g = torch.Generator().manual_seed(1)
    batch = GroupedBatch.from_groups([torch.randint(1, 30, (12,), generator=g)],
                                     [[torch.randint(1, 30, (n,), generator=g) for n in (2, 1)]])
    logits = torch.randn(batch.num_tokens, 30, dtype=torch.float64, generator=g, requires_grad=True)
    whole = batch.logprobs(logits)
    padded = torch.cat([logits, logits.new_zeros(-batch.num_tokens % world, 30)])
    c = padded.shape[0] // world
    total, empty = torch.zeros_like(whole), 0
    for r in range(world):
        monkeypatch.setattr(sharding, "group_rank_world", lambda group, r=r: (r, world))
        keep = sharding.rank_rows(batch, object())[0]                             # what model_inputs passes
        empty += keep.numel() == 0
        part = batch.logprobs(padded[r * c:(r + 1) * c][keep][None], shard=object())
        assert part.grad_fn is not None                                          # every rank's backward runs
        total = total + part
    assert torch.equal(total, whole) and empty >= 1
    total.sum().backward()
