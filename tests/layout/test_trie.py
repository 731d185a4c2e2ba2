"""``build_trie`` (whole-sequence, sort-based) against a per-token dictionary trie: the same segments,
parents, paths, sources and trees on random batches (shared prefixes, duplicates, strict prefixes,
empty sequences, non-integer keys)."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from flexgroup.layout.trie import build_trie

from _core_reference import one_torch_thread  # noqa: F401  (autouse fixture)


def ref_trie(sequences):
    """(parents, lengths, paths, source, tree_of, tree_tokens) by walking a dict per node, token by token."""
    children, parent, source, node_paths = [{}], [-1], [(-1, -1)], []
    for i, seq in enumerate(sequences):
        node, path = 0, []
        for t, key in enumerate(seq):
            if key not in children[node]:
                children[node][key] = len(parent)
                children.append({})
                parent.append(node)
                source.append((i, t))
            node = children[node][key]
            path.append(node)
        node_paths.append(path)
    phys, seg_of = [0] * len(parent), [0] * len(parent)
    order, seg_parents, seg_lengths, seg_tree = [], [], [], []
    stack = list(reversed(children[0].values()))
    while stack:  # pre-order, children in order of first appearance
        x = stack.pop()
        phys[x] = len(order)
        order.append(x)
        stack.extend(reversed(children[x].values()))
        p = parent[x]
        if p == 0 or len(children[p]) > 1:
            seg_parents.append(-1 if p == 0 else seg_of[p])
            seg_tree.append(seg_tree[seg_of[p]] if p else (seg_tree[-1] + 1 if seg_tree else 0))
            seg_lengths.append(0)
        seg_lengths[-1] += 1
        seg_of[x] = len(seg_lengths) - 1
    tree_tokens = [sum(ln for tr, ln in zip(seg_tree, seg_lengths) if tr == k) for k in range(len(set(seg_tree)))]
    return (seg_parents, seg_lengths, [[phys[x] for x in p] for p in node_paths], [source[x] for x in order],
            [seg_tree[seg_of[p[0]]] if p else -1 for p in node_paths], tree_tokens)


@st.composite
def batches(draw, keys=st.integers(0, 3)):
    """Sequences that often continue a prefix of an earlier one (GRPO groups, tree rollouts, duplicates)."""
    seqs = []
    for _ in range(draw(st.integers(0, 10))):
        head = []
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            head = base[: draw(st.integers(0, len(base)))]
        seqs.append(head + draw(st.lists(keys, max_size=6)))
    return seqs


def assert_same_trie(seqs):
    trie = build_trie(seqs)
    parents, lengths, paths, source, tree_of, tree_tokens = ref_trie(seqs)
    assert list(trie.parents) == parents and list(trie.lengths) == lengths
    assert [p.tolist() for p in trie.paths] == paths
    assert trie.source.shape == (len(source), 2) and [tuple(s) for s in trie.source.tolist()] == source
    assert list(trie.tree_of) == tree_of and list(trie.tree_tokens) == tree_tokens


@settings(max_examples=300, deadline=None)
@given(batches())
def test_build_trie_equals_the_per_token_dictionary_trie(seqs):
    assert_same_trie(seqs)


@settings(max_examples=100, deadline=None)
@given(batches(st.sampled_from(["a", "b", ("c", 1), 2.5, None])))
def test_build_trie_equals_the_dictionary_trie_on_non_integer_keys(seqs):
    assert_same_trie(seqs)


def test_int_keys_equal_as_in_a_dict_share_nodes_and_tensors_read_by_value():
    # True == 1 and 2**70 (no int64) are dict keys like any other; a tensor's values are its keys
    assert_same_trie([[1, 2, 3], [True, 2], [2 ** 70, 1], [2 ** 70, 2]])
    trie = build_trie([torch.tensor([5, 6, 7]), torch.tensor([5, 6, 8])])
    assert trie.lengths == (2, 1, 1) and trie.parents == (-1, 0, 0)


def test_a_long_batch_of_groups_shares_each_prompt_once():
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(4):
        prompt = torch.randint(0, 50_000, (300,), generator=g).tolist()
        seqs += [prompt + torch.randint(0, 50_000, (int(n),), generator=g).tolist() for n in (40, 1, 0, 90)]
    trie = build_trie(seqs)
    assert trie.num_tokens == 4 * (300 + 40 + 1 + 90)
    assert_same_trie(seqs)
