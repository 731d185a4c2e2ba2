"""Per sequence means per sequence: a sequence may end inside a segment (a strict prefix of another, a
duplicate), and its length, the per-token sequence counts and the cost follow the batch's sequences,
never the tree's leaves.

Oracle: sequences rebuilt by the parent walk of ``_core_reference.ref_paths`` (a root-to-leaf path cut
at the sequence's last token), counted and measured by hand.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexgroup import GroupedBatch, Layout
from flexgroup.patches import _guards
from flexgroup.patches._guards import ModelGuards

from _core_reference import forests, one_torch_thread, ref_paths  # noqa: F401 (fixture)


def _ref_sequences(parents, lengths, ends) -> list[list[int]]:
    """Token indices of each sequence: any root-to-leaf path through its end, cut after the end."""
    out = []
    for e in ends:
        path = next(p for p in ref_paths(parents, lengths) if e in p)
        out.append(path[: path.index(e) + 1])
    return out


@st.composite
def forests_with_ends(draw):
    """(parents, lengths, ends): ends anywhere in the row (mid-segment, repeated), every leaf's end included
    or not."""
    parents, lengths = draw(forests(max_segments=6, max_len=6))
    L = sum(lengths)
    ends = draw(st.lists(st.integers(0, L - 1), min_size=1, max_size=8))
    return parents, lengths, ends


@settings(max_examples=150, deadline=None)
@given(forests_with_ends())
def test_sequence_lengths_counts_and_cost_follow_the_sequences_not_the_leaves(case):
    parents, lengths, ends = case
    lay = Layout.tree(parents, lengths)
    seqs = _ref_sequences(parents, lengths, ends)
    assert lay.sequence_lengths(ends) == [len(s) for s in seqs]
    counts = [0] * lay.num_tokens
    for s in seqs:
        for t in s:
            counts[t] += 1
    assert lay.sequence_counts(ends).tolist() == counts
    c = lay.cost(ends)
    assert c.baseline_tokens == sum(len(s) for s in seqs)
    assert c.baseline_pairs == sum(len(s) * (len(s) + 1) // 2 for s in seqs)
    assert (c.grouped_tokens, c.grouped_pairs) == (lay.num_tokens, lay.cost().grouped_pairs)


@settings(max_examples=60, deadline=None)
@given(forests(max_segments=6, max_len=6))
def test_without_ends_the_sequences_are_the_root_to_leaf_paths(tree):
    lay = Layout.tree(*tree)
    paths = ref_paths(*tree)
    assert lay.sequence_lengths() == [len(p) for p in paths]
    assert lay.cost() == lay.cost(lay.leaf_ends)
    assert [p[-1] for p in paths] == list(lay.leaf_ends)


def test_three_sequences_one_a_prefix_of_another_cost_what_running_them_one_by_one_costs():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(1, 50, (13,), generator=g), torch.randint(1, 50, (5,), generator=g)
    seqs = [a[:10], a, torch.cat([a[:5], b])]  # 10, 13 and 10 tokens; the first a strict prefix of the second
    batch = GroupedBatch.from_sequences(seqs)
    assert batch.cost().baseline_tokens == 33
    assert batch.cost().baseline_pairs == 55 + 91 + 55
    assert batch.cost().grouped_tokens == batch.num_tokens == 18
    assert batch.layout.cost().baseline_tokens == 23  # the leaves alone miss the prefix sequence


@st.composite
def sequence_sets(draw):
    """Token sequences over a 3-token vocabulary (so prefixes are shared), plus strict prefixes and
    duplicates of some of them."""
    tok = st.integers(1, 3)
    seqs = draw(st.lists(st.lists(tok, min_size=2, max_size=7), min_size=1, max_size=4))  # not all 1-token
    for _ in range(draw(st.integers(0, 3))):
        src = seqs[draw(st.integers(0, len(seqs) - 1))]
        cut = draw(st.integers(1, len(src)))
        seqs.append(src[:cut])  # a strict prefix or (cut = len) a duplicate
    order = draw(st.permutations(range(len(seqs))))
    return [seqs[i] for i in order]


def test_the_rope_guards_judge_each_sequence_by_its_own_length():
    told_apart = []  # examples where the old guard (root-to-leaf paths only) decides otherwise

    @settings(max_examples=150, deadline=None)
    @given(sequence_sets(), st.integers(1, 8))
    def prop(seqs, limit):
        batch = GroupedBatch.from_sequences([torch.tensor(s) for s in seqs])
        lens = [len(s) for s in seqs]
        for guards, refuse in ((ModelGuards(longrope=(limit,)), min(lens) <= limit < max(lens)),
                               (ModelGuards(dynamic=limit), max(lens) > limit and min(lens) != max(lens))):
            for ends in (batch.sequence_ends, None):
                try:
                    guards.check(batch.layout, "m", ends)
                    refused = False
                except ValueError:
                    refused = True
                if ends is not None:
                    assert refused == refuse, (seqs, limit, guards)
                elif refused != refuse:
                    told_apart.append(seqs)

    prop()
    assert told_apart  # the strategy makes prefix sequences that the leaves alone misjudge


def test_the_moe_weights_count_every_sequence_through_each_token():
    told_apart = []  # examples where the old weights (root-to-leaf paths only) differ

    @settings(max_examples=150, deadline=None)
    @given(sequence_sets())
    def prop(seqs):
        batch = GroupedBatch.from_sequences([torch.tensor(s) for s in seqs])
        got = _guards.sequence_weights(batch.model_inputs()["attention_mask"]).tolist()
        # independent: packed token j stands for the token prefix that ends at it (the first path through it,
        # read from the parent walk); a sequence contains j iff it starts with that prefix
        lay = batch.layout
        ids = batch.input_ids.tolist()
        want = []
        for j in range(lay.num_tokens):
            path = next(p for p in ref_paths(lay.parents, lay.lengths) if j in p)
            prefix = [ids[t] for t in path[: path.index(j) + 1]]
            want.append(sum(s[: len(prefix)] == prefix for s in seqs))
        assert got == want
        if lay.sequence_counts().tolist() != want:
            told_apart.append(seqs)

    prop()
    assert told_apart


def test_the_guard_fed_the_leaves_cannot_tell_a_prefix_sequence_apart():
    # the old behaviour: a 4-token sequence that is a strict prefix of a 9-token one is not a leaf
    batch = GroupedBatch.from_sequences([torch.arange(1, 10), torch.arange(1, 5)])
    ModelGuards(longrope=(5,)).check(batch.layout, "m")  # leaves only: one 9-token path, no complaint
    with pytest.raises(ValueError, match=r"1 sequence\(s\) of <= 5 tokens and 1 longer \(up to 9\)"):
        ModelGuards(longrope=(5,)).check(batch.layout, "m", batch.sequence_ends)


def test_bad_sequence_ends_are_named():
    lay = Layout.group(3, [2])
    with pytest.raises(ValueError, match="sequence end 5 is outside the row of 5 tokens"):
        lay.cost([5])
    with pytest.raises(ValueError, match=r"ends\[0\] = -1"):
        lay.sequence_lengths([-1])
