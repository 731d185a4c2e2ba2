"""The streaming schedule (flexgroup.stream.plan): every token runs once, within the budget, after its ancestors.

Oracle: the trie's own Layout (positions, ancestors) -- the schedule is checked against the packed
row it cuts, token by token.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexgroup import Layout
from flexgroup.layout.checks import check_loss_masks
from flexgroup.stream.plan import plan_stream


def _forest(seed: int):
    rng = random.Random(seed)
    system = [rng.randrange(1, 50) for _ in range(rng.randint(1, 400))]
    seqs = []
    for _ in range(rng.randint(1, 6)):
        base = list(rng.choice(seqs)) if seqs and rng.random() < 0.6 else list(system)
        cut = rng.randint(1, len(base))
        kind = rng.random()
        if kind < 0.15:
            seqs.append(base[:cut])  # strict prefix (or duplicate)
        else:
            seqs.append(base[:cut] + [rng.randrange(1, 50) for _ in range(rng.randint(1, 300))])
    if rng.random() < 0.3:  # an unrelated small tree
        seqs.append([99] + [rng.randrange(1, 50) for _ in range(rng.randint(1, 60))])
    seqs = [torch.tensor(s) for s in seqs]
    masks = check_loss_masks(None, seqs)
    return seqs, masks


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), budget=st.sampled_from([128, 200, 512, 4096]))
def test_every_token_runs_once_within_the_budget_after_its_kept_ancestors(seed, budget):
    seqs, masks = _forest(seed)
    plan = plan_stream(seqs, masks, budget)
    trie = plan.trie
    lay = Layout.tree(trie.parents, trie.lengths)
    pos = lay.position_ids
    runs = torch.zeros(trie.num_tokens, dtype=torch.long)
    for row in plan.rows:  # packed rows: whole trees, within the budget
        toks = torch.unique(torch.cat([trie.paths[k] for k in row]))
        assert toks.numel() <= budget
        runs[toks] += 1
    kept: dict[int, int] = {}
    for c, ch in enumerate(plan.chunks):
        assert ch.tokens.numel() <= budget and ch.row_layout.num_tokens == ch.tokens.numel()
        runs[ch.tokens] += 1
        for p, _, _ in ch.keep:
            kept[p] = c
        # the chunk's layout: context then own tokens, at their true virtual positions
        n = ch.n_context
        assert torch.equal(ch.layout.position_ids[n:], pos[ch.tokens]) and torch.equal(ch.positions, pos[ch.tokens])
    for c, ch in enumerate(plan.chunks):
        for p in ch.context:  # kept by an earlier chunk that lists this chunk as a reader
            assert kept[p] < c and c in plan.chunks[kept[p]].readers
        # each own token sees as many tokens (kept context + own, causally) as its sequence has before it
        seen = ch.layout.dense_mask()[ch.n_context:].sum(1)
        assert torch.equal(seen, pos[ch.tokens] + 1)
    assert bool((runs == 1).all()), "a token ran twice or never"
    ends = [k for ch in plan.chunks if ch.sequences is not None for k in ch.sequences.tolist()]
    packed = [k for row in plan.rows for k in row]
    assert sorted(ends + packed) == list(range(len(seqs)))


def test_a_tree_that_fits_is_one_packed_row_and_nothing_streams():
    seqs = [torch.arange(1, 100), torch.cat([torch.arange(1, 50), torch.arange(200, 260)])]
    plan = plan_stream(seqs, check_loss_masks(None, seqs), 4096)
    assert plan.rows == [[0, 1]] and plan.chunks == []


@pytest.mark.parametrize("budget", [128, 1000])
def test_a_group_streams_its_prompt_once_and_its_responses_against_the_kept_prompt(budget):
    prompt = torch.randint(1, 50, (600,), generator=torch.Generator().manual_seed(0))
    seqs = [torch.cat([prompt, torch.full((100,), 50 + i)]) for i in range(8)]
    plan = plan_stream(seqs, check_loss_masks(None, seqs), budget)
    assert sum(ch.tokens.numel() for ch in plan.chunks) == 600 + 8 * 100
    prompt_chunks = {c for c, ch in enumerate(plan.chunks) for p, _, _ in ch.keep}
    last = max(prompt_chunks)
    for ch in plan.chunks[last + 1:]:  # response-only chunks read the whole prompt from kept K/V
        assert ch.n_context == 600


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), budget=st.sampled_from([128, 200, 512]))
def test_a_chunk_whose_graph_waits_for_later_chunks_holds_only_segments_bigger_than_the_budget(seed, budget):
    # a whole subtree beside such pieces would keep its activations until the readers ran; alone, it is freed
    seqs, masks = _forest(seed)
    plan = plan_stream(seqs, masks, budget)
    lay = Layout.tree(plan.trie.parents, plan.trie.lengths)
    sub = list(lay.lengths)
    for s in reversed(range(lay.num_segments)):
        if lay.parents[s] >= 0:
            sub[lay.parents[s]] += sub[s]
    seg_of = torch.repeat_interleave(torch.arange(lay.num_segments), torch.tensor(lay.lengths))
    for ch in plan.chunks:
        if ch.readers:
            assert all(sub[s] > budget for s in seg_of[ch.tokens].tolist())


def test_the_tail_of_a_long_prompt_and_its_responses_share_the_last_chunk():
    prompt = torch.randint(1, 50, (420,), generator=torch.Generator().manual_seed(0))
    seqs = [torch.cat([prompt, torch.full((n,), 50 + n)]) for n in (30, 50, 5)]
    plan = plan_stream(seqs, check_loss_masks(None, seqs), 128)
    assert [ch.tokens.numel() for ch in plan.chunks] == [128, 128, 128, 36 + 85]
    assert not plan.chunks[-1].readers
