"""Acceptance tests for flexgroup.Layout: constructors, validation, positions, paths, cost, immutability."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from flexgroup import Cost, Layout
from flexgroup.layout import masks

from _core_reference import one_torch_thread  # noqa: F401  (autouse fixture)
from _core_reference import forests, layouts, ref_dense_mask, ref_paths, ref_position_ids

SETTINGS = settings(max_examples=40, deadline=None)


# ------------------------------------------------------------------ constructors


def test_group_is_a_two_level_tree_with_the_prompt_first():
    lay = Layout.group(5, [3, 4, 2])
    assert lay.parents == (-1, 0, 0, 0)
    assert lay.lengths == (5, 3, 4, 2)
    assert lay.num_tokens == 14
    assert lay == Layout.tree([-1, 0, 0, 0], [5, 3, 4, 2])
    assert hash(lay) == hash(Layout.tree([-1, 0, 0, 0], [5, 3, 4, 2]))


def test_group_positions_restart_after_the_prompt_for_every_response():
    lay = Layout.group(3, [2, 4])
    assert lay.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6]
    assert lay.position_ids.dtype == torch.long
    assert lay.max_position == 6


def test_tree_positions_continue_from_the_parent_segment():
    lay = Layout.tree([-1, 0, 1, 0], [2, 3, 1, 2])
    assert lay.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 2, 3]
    assert lay.offsets == (0, 2, 5, 2)
    assert lay.ancestors == ((), (0,), (0, 1), (0,))


def test_tree_accepts_tensors_and_numpy_integers():
    a = Layout.tree(torch.tensor([-1, 0]), torch.tensor([3, 2]))
    b = Layout.tree(np.array([-1, 0]), np.array([3, 2]))
    c = Layout.group(np.int64(3), [torch.tensor(2)])
    assert a == b == c == Layout.tree([-1, 0], [3, 2])
    assert all(type(x) is int for x in a.parents + a.lengths + c.lengths)


def test_pack_keeps_each_layout_positions_and_offsets_parents():
    a, b = Layout.group(2, [1, 1]), Layout.tree([-1, 0], [3, 2])
    lay = Layout.pack([a, b])
    assert lay.parents == (-1, 0, 0, -1, 3)
    assert lay.lengths == (2, 1, 1, 3, 2)
    assert lay.position_ids.tolist() == a.position_ids.tolist() + b.position_ids.tolist()
    assert lay.num_tokens == a.num_tokens + b.num_tokens


def test_packed_layouts_never_attend_to_each_other():
    a, b = Layout.group(2, [2]), Layout.group(3, [1, 2])
    m = Layout.pack([a, b]).dense_mask()
    na = a.num_tokens
    assert not m[na:, :na].any() and not m[:na, na:].any()
    assert torch.equal(m[:na, :na], a.dense_mask()) and torch.equal(m[na:, na:], b.dense_mask())


def test_pack_of_packs_equals_the_flat_pack():
    a, b, c = Layout.group(2, [1]), Layout.tree([-1], [4]), Layout.group(1, [1, 1])
    assert Layout.pack([Layout.pack([a, b]), c]) == Layout.pack([a, b, c])


def test_interleaved_forest_keeps_each_tree_separate():
    # root 0 -> 2, root 1 -> 3: tree 1's root sits between tree 0's segments
    lay = Layout.tree([-1, -1, 0, 1], [2, 3, 2, 1])
    assert lay.position_ids.tolist() == [0, 1, 0, 1, 2, 2, 3, 3]
    m = lay.dense_mask()
    tree0 = [0, 1, 5, 6]
    tree1 = [2, 3, 4, 7]
    assert not m[tree0][:, tree1].any() and not m[tree1][:, tree0].any()
    assert lay.roots == (0, 1) and lay.component == (0, 1, 0, 1)


def test_response_attends_to_prefix_not_siblings():
    lay = Layout.group(3, [2, 2])
    m = lay.dense_mask()
    r1, r2 = [3, 4], [5, 6]
    assert m[r2][:, :3].all()  # whole prompt
    assert not m[r2][:, r1].any() and not m[r1][:, r2].any()  # siblings invisible
    assert m[r2][:, r2].tolist() == [[True, False], [True, True]]  # causal inside the response
    assert not m[:3, 3:].any()  # the prompt never sees responses


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("call, needle", [
    (lambda: Layout.group(0, [2]), "prefix_len = 0"),
    (lambda: Layout.group(3, [2, 0]), "response_lens[1] = 0"),
    (lambda: Layout.group(3, []), "response_lens is empty"),
    (lambda: Layout.group(3, [-2]), "response_lens[0] = -2"),
    (lambda: Layout.group(2.5, [1]), "prefix_len must be an integer, got 2.5"),
    (lambda: Layout.group(3, [1.0]), "response_lens[0] must be an integer, got 1.0"),
    (lambda: Layout.group(True, [1]), "prefix_len must be an integer, got True"),
    (lambda: Layout.tree([-1, 0], [3, 0]), "lengths[1] = 0"),
    (lambda: Layout.tree([-1, 0], [3, -1]), "lengths[1] = -1"),
    (lambda: Layout.tree([-1], ["3"]), "lengths[0] must be an integer, got '3'"),
    (lambda: Layout.tree([-1], [torch.tensor(2.0)]), "lengths[0] must be an integer"),
    (lambda: Layout.tree([-1, 1], [3, 2]), "parents[1] = 1"),
    (lambda: Layout.tree([-1, 2, 0], [3, 2, 1]), "parents[1] = 2"),
    (lambda: Layout.tree([0], [3]), "parents[0] = 0"),
    (lambda: Layout.tree([-1, -2], [3, 2]), "parents[1] = -2"),
    (lambda: Layout.tree([-1, 0.0], [3, 2]), "parents[1] must be an integer, got 0.0"),
    (lambda: Layout.tree([-1, 0], [3]), "parents has 2 entries but lengths has 1"),
    (lambda: Layout.tree([], []), "no segments"),
    (lambda: Layout.pack([]), "empty list"),
    (lambda: Layout.pack([Layout.group(1, [1]), (1, 2)]), "item 1 is tuple"),
    (lambda: Layout.pack(Layout.group(1, [1])), "a single Layout"),
    (lambda: Layout.group(3, 5), "response_lens must be a list, got 5"),
    (lambda: Layout.group(3, torch.tensor(5)), "response_lens must be a list, got 5"),
    (lambda: Layout.tree(-1, [3]), "parents must be a list, got -1"),
    (lambda: Layout.tree([-1], "3"), "lengths must be a list, got '3'"),
])
def test_invalid_layouts_raise_value_error_naming_the_bad_value(call, needle):
    with pytest.raises(ValueError) as e:
        call()
    assert needle in str(e.value)


# ------------------------------------------------------------------ positions, paths, masks


def test_paths_list_leaves_in_order_of_appearance():
    lay = Layout.tree([-1, 0, -1, 1, 0, 2], [2, 1, 3, 1, 2, 1])
    assert lay.leaves == (3, 4, 5)
    assert [p.tolist() for p in lay.paths()] == [[0, 1, 2, 6], [0, 1, 7, 8], [3, 4, 5, 9]]
    assert all(p.dtype == torch.long for p in lay.paths())


@SETTINGS
@given(forests(max_segments=10))
def test_position_ids_along_every_path_count_from_zero(pl):
    lay = Layout.tree(*pl)
    for path in lay.paths():
        assert torch.equal(lay.position_ids[path], torch.arange(len(path)))
    assert torch.equal(lay.position_ids, ref_position_ids(*pl))
    assert lay.max_position == int(lay.position_ids.max())


@SETTINGS
@given(layouts(max_segments=10))
def test_paths_match_an_independent_parent_walk(lay):
    assert [p.tolist() for p in lay.paths()] == ref_paths(lay.parents, lay.lengths)
    assert lay.num_tokens == sum(lay.lengths) == len(lay.position_ids)
    for path in lay.paths():  # every path starts at a root and visits tokens in physical order
        assert lay.parents[lay.seg_id[path[0]]] == -1
        assert bool((path[1:] > path[:-1]).all())


@SETTINGS
@given(layouts(max_segments=8, max_len=12))
def test_dense_mask_equals_the_union_of_per_path_causal_masks(lay):
    assert torch.equal(lay.dense_mask(), ref_dense_mask(lay.parents, lay.lengths))


@SETTINGS
@given(layouts(max_segments=8, max_len=12))
def test_mask_mod_equals_the_dense_oracle_elementwise(lay):
    L = lay.num_tokens
    i = torch.arange(L)
    got = masks.mask_mod(lay)(0, 0, i[:, None], i[None, :])
    assert torch.equal(got, ref_dense_mask(lay.parents, lay.lengths))


# ------------------------------------------------------------------ cost


def group_cost(P: int, R: list[int]) -> tuple[int, int, int, int]:
    """DESIGN.md's formulas, written out independently."""
    return (
        sum(P + r for r in R),
        P + sum(R),
        sum((P + r) * (P + r + 1) // 2 for r in R),
        P * (P + 1) // 2 + sum(r * P + r * (r + 1) // 2 for r in R),
    )


@pytest.mark.parametrize("P, R", [(1, [1]), (300, [50, 64, 20]), (512, [64] * 8), (7, [1, 100])])
def test_group_cost_matches_the_design_formulas(P, R):
    c = Layout.group(P, R).cost()
    assert isinstance(c, Cost)
    assert (c.baseline_tokens, c.grouped_tokens, c.baseline_pairs, c.grouped_pairs) == group_cost(P, R)


@SETTINGS
@given(layouts(max_segments=8, max_len=16))
def test_cost_counts_per_path_pairs_and_dense_mask_pairs(lay):
    c = lay.cost()
    paths = ref_paths(lay.parents, lay.lengths)
    assert c.baseline_tokens == sum(len(p) for p in paths)
    assert c.grouped_tokens == lay.num_tokens
    assert c.baseline_pairs == sum(len(p) * (len(p) + 1) // 2 for p in paths)
    assert c.grouped_pairs == int(ref_dense_mask(lay.parents, lay.lengths).sum())


def test_cost_ratios_and_ideal_speedup():
    c = Layout.group(10, [2, 2]).cost()
    b_tok, g_tok, b_pairs, g_pairs = group_cost(10, [2, 2])
    assert c.token_ratio == pytest.approx(b_tok / g_tok)
    assert c.pair_ratio == pytest.approx(b_pairs / g_pairs)
    assert c.ideal_speedup(3.0, 0.0) == pytest.approx(c.token_ratio)
    assert c.ideal_speedup(0.0, 5.0) == pytest.approx(c.pair_ratio)
    assert c.ideal_speedup(2.0, 1.0) == pytest.approx((2 * b_tok + b_pairs) / (2 * g_tok + g_pairs))
    a, b = Layout.group(3, [1]), Layout.group(4, [2, 2])
    assert a.cost() + b.cost() == Layout.pack([a, b]).cost()


def test_a_single_sequence_costs_the_same_as_its_baseline():
    c = Layout.tree([-1], [17]).cost()
    assert c.baseline_tokens == c.grouped_tokens == 17
    assert c.baseline_pairs == c.grouped_pairs == 17 * 18 // 2


# ------------------------------------------------------------------ immutability


def test_layout_is_immutable():
    lay = Layout.group(3, [2])
    for name, value in [("parents", (-1,)), ("lengths", (1, 1)), ("num_tokens", 9), ("new_attr", 1)]:
        with pytest.raises(AttributeError):
            setattr(lay, name, value)
    with pytest.raises(AttributeError):
        del lay.parents
    assert isinstance(lay.parents, tuple) and isinstance(lay.lengths, tuple)
    assert lay.num_tokens == 5


def test_editing_returned_position_ids_does_not_change_the_layout():
    lay = Layout.group(3, [2])
    pos = lay.position_ids
    pos += 100
    assert lay.position_ids.tolist() == [0, 1, 2, 3, 4]
    assert lay.dense_mask().sum() == lay.cost().grouped_pairs
    paths = lay.paths()
    paths[0][0] = 4
    assert lay.paths()[0].tolist() == [0, 1, 2, 3, 4]


def test_input_lists_are_copied_not_aliased():
    parents, lengths = [-1, 0], [3, 2]
    lay = Layout.tree(parents, lengths)
    parents[1], lengths[0] = -1, 9
    assert lay.parents == (-1, 0) and lay.lengths == (3, 2)


def test_repr_names_the_structure():
    assert repr(Layout.group(3, [2])) == "Layout(parents=[-1, 0], lengths=[3, 2])"
    big = Layout.pack([Layout.group(2, [1] * 7)] * 3)
    assert "24 segments" in repr(big) and "3 trees" in repr(big)
