"""A group's forward log-probs and entropies are bitwise the same whatever shares its row (issue 43).

Group A (a prompt and four responses; or a multi-turn tree with branches, a strict prefix and a
duplicate) is run alone, then packed after, before and between other groups chosen to meet every
place where a packed row could mix them in the ``lse`` backend: a row-mate with A's prompt length and
response lengths (the same part shapes, which the plan used to batch into one call), one with a longer
response (which used to pad A's responses further), and a batch-wide trie / micro-batches around A's
tree. Oracle: A alone, compared with ``torch.equal`` (no tolerance). Tiny zoo models (Llama: GQA;
Qwen2: a window of 8 on its upper layer, shorter than the prompts), float32 and bfloat16, both CPU
backends; the lse backend's grid has cells of 8 tokens (every query's keys in several merged parts), and the
trie tests also run it at its default.
"""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch, micro_batches
from flexgroup.models.zoo import build_model
from flexgroup.kernels import lse_plan

BACKENDS = ["lse", "sdpa"]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
ARCHS = ["llama", "qwen2"]


@pytest.fixture(autouse=True)
def short_chunks(monkeypatch):
    """The lse backend's grid cut at 8 tokens: the tiny rows' keys come in many merged parts."""
    monkeypatch.setattr(lse_plan, "CHUNK", 8)


def _ids(g: torch.Generator, n: int, first: int | None = None) -> torch.Tensor:
    x = torch.randint(3, 128, (n,), generator=g)
    if first is not None:
        x[0] = first                # trees never merge in a trie: each starts with its own token
    return x


def _model(arch: str, backend: str, dtype: torch.dtype):
    return flexgroup.patch(build_model(arch, dtype), backend=backend)


def _scores(model, batch: GroupedBatch, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[n, T]`` of ``rows`` of ``batch`` (the needed logit rows only, as in training)."""
    with torch.no_grad():
        logits = model(**batch.model_inputs(needed_logits_only=True)).logits
    lp, ent = batch.logprobs(logits, return_entropy=True)
    return lp[rows], ent[rows]


def _assert_bitwise(alone, packed, where: str) -> None:
    for name, a, b in zip(("log-probs", "entropies"), alone, packed):
        T = a.shape[1]
        b = b[:, :T]                                # a wider row-mate pads the batch's columns with 0
        assert torch.equal(a, b), f"{name} {where}: max |diff| {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_group_logprobs_do_not_depend_on_its_row_mates_their_order_or_its_offset(arch, backend, dtype):
    g = torch.Generator().manual_seed(0)
    a = (_ids(g, 40, 5), [_ids(g, n) for n in (30, 45, 12, 21)])
    same_shape = (_ids(g, 40, 6), [_ids(g, n) for n in (30, 45, 12, 21)])
    longer = (_ids(g, 33, 7), [_ids(g, n) for n in (70, 9)])
    model = _model(arch, backend, dtype)

    def run(groups, first):
        batch = GroupedBatch.from_groups([p for p, _ in groups], [r for _, r in groups])
        return _scores(model, batch, slice(first, first + 4))

    alone = run([a], 0)
    _assert_bitwise(alone, run([same_shape, a], 4), "after a group of the same shape")
    _assert_bitwise(alone, run([a, same_shape], 0), "before a group of the same shape")
    _assert_bitwise(alone, run([a, longer], 0), "before a group with a longer response")
    _assert_bitwise(alone, run([longer, a, same_shape], 2), "between two groups")


def _tree(g: torch.Generator, first: int) -> list[torch.Tensor]:
    """A multi-turn tree: a shared prompt, a shared first turn that branches twice, a strict prefix, a duplicate."""
    p, t1, t2 = _ids(g, 24, first), _ids(g, 14), _ids(g, 19)
    s = [torch.cat([p, t1, _ids(g, 11)]), torch.cat([p, t1, _ids(g, 26)]), torch.cat([p, t2])]
    return s + [torch.cat([p, t1[:5]]), s[2].clone()]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_sequence_logprobs_depend_only_on_their_own_tree_in_a_batch_wide_trie(arch, backend, dtype):
    g = torch.Generator().manual_seed(1)
    a = _tree(g, 5)
    others = _tree(g, 6) + [torch.cat([_ids(g, 24, 7), _ids(g, n)]) for n in (19, 33, 8)]
    model = _model(arch, backend, dtype)
    n = len(a)
    alone = _scores(model, GroupedBatch.from_sequences(a), slice(0, n))
    _assert_bitwise(alone, _scores(model, GroupedBatch.from_sequences(others + a), slice(len(others), None)),
                    "after other trees")
    mixed = others[:3] + a + others[3:]
    _assert_bitwise(alone, _scores(model, GroupedBatch.from_sequences(mixed), slice(3, 3 + n)), "between other trees")
    # micro-batches of two budgets: A's tree shares its row with one other tree (200), with all of them (400)
    for budget in (200, 400):
        mb = micro_batches(mixed, budget)
        (b, i0), rows = mb.where[3], [mb.where[3 + k] for k in range(n)]
        assert all(r[0] == b for r in rows) and [r[1] for r in rows] == list(range(i0, i0 + n))
        _assert_bitwise(alone, _scores(model, mb.batches[b], slice(i0, i0 + n)), f"in micro-batches of {budget}")


def _fused_scores(model, batch: GroupedBatch, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_scores` through the fused readout (hidden states and the LM head, no logits)."""
    from flexgroup.data.fused_readout import hidden_forward

    with torch.no_grad():
        hidden, head = hidden_forward(model, batch.model_inputs(needed_logits_only=True))
        lp, ent = batch.logprobs(hidden, lm_head=head, return_entropy=True)
    return lp[rows], ent[rows]


@pytest.mark.parametrize("readout", ["logits", "fused"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_scored_at_few_positions_is_invariant_too(backend, readout):
    """A group read at 2 logit rows (a one-token response and a two-token one): the LM head runs on at least
    16 rows (``GroupedBatch.head_rows``); run on the 2 rows alone, its float32 matmul takes another kernel
    than beside a row-mate's rows, and the group's log-probs move (the broken variant below)."""
    g = torch.Generator().manual_seed(2)
    a = (_ids(g, 40, 5), [_ids(g, 1), _ids(g, 2)])
    mate = (_ids(g, 40, 6), [_ids(g, n) for n in (30, 45, 12, 21)])
    model = _model("llama", backend, torch.float32)

    def run(groups, first):
        batch = GroupedBatch.from_groups([p for p, _ in groups], [r for _, r in groups])
        return (_scores if readout == "logits" else _fused_scores)(model, batch, slice(first, first + 2))

    alone = run([a], 0)
    assert GroupedBatch.from_groups([a[0]], [a[1]]).logit_rows.numel() == 2
    _assert_bitwise(alone, run([mate, a], 4), "after a row-mate")
    _assert_bitwise(alone, run([a, mate], 0), "before a row-mate")



def test_the_head_rows_padding_is_what_makes_few_rows_invariant(monkeypatch):
    """Broken variant: the LM head run on the group's 2 logit rows only (no padding) gives other logits."""
    from flexgroup.data import batch as batch_module
    g = torch.Generator().manual_seed(2)
    a = (_ids(g, 40, 5), [_ids(g, 1), _ids(g, 2)])
    mate = (_ids(g, 40, 6), [_ids(g, n) for n in (30, 45, 12, 21)])
    model = _model("llama", "lse", torch.float32)
    w = model.lm_head.weight.detach()
    x = torch.randn(40, w.shape[1], generator=g)
    if torch.equal(torch.nn.functional.linear(x[:2], w), torch.nn.functional.linear(x, w)[:2]):
        pytest.skip("this machine's float32 matmul gives 2 rows the same bits as 40: nothing to break")

    def a_logits():
        """The logits of A's 2 read rows, A alone and A after a row-mate: [2, V] each."""
        alone, packed = GroupedBatch.from_groups([a[0]], [a[1]]), GroupedBatch.from_groups(*zip(mate, a))
        with torch.no_grad():
            la = model(**alone.model_inputs(needed_logits_only=True)).logits[0, :2]
            lp = model(**packed.model_inputs(needed_logits_only=True)).logits[0]
        return la, lp[torch.searchsorted(packed.logit_rows, packed.logit_rows[-2:])]

    assert torch.equal(*a_logits())
    monkeypatch.setattr(batch_module, "HEAD_ROWS", 0)
    assert not torch.equal(*a_logits())


def _system_prompted(g: torch.Generator, system: torch.Tensor, prompt: int, responses) -> list[torch.Tensor]:
    p = torch.cat([system, _ids(g, prompt)])
    return [torch.cat([p, _ids(g, n)]) for n in responses]


@pytest.mark.parametrize("chunk", [8, 256])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("arch", ARCHS)
def test_a_groups_numbers_do_not_depend_on_the_trie_around_its_sequences(arch, dtype, chunk, monkeypatch):
    """Group A's sequences alone vs in tries of another shape around them: a system prompt shared with other
    groups (a segment of its own in the batch-wide trie, not inside A's prompt segment), only some of A's
    responses (a micro-batch that splits the group), and A streamed in chunks smaller than its tree. The lse backend's grid plan cuts a query's keys at the same
    virtual positions in all of them (chunk 8: many cells; 256: one cell per sequence at these lengths), also
    under the tiny Qwen2's window of 8 (its upper layer)."""
    monkeypatch.setattr(lse_plan, "CHUNK", chunk)
    g = torch.Generator().manual_seed(3)
    system = _ids(g, 21, 5)
    a = _system_prompted(g, system, 30, (60, 90, 24, 42))   # 267 tokens as one tree
    b = _system_prompted(g, system, 17, (9, 40))
    c = _system_prompted(g, system[:6], 25, (33,))         # shares only the system prompt's first 6 tokens
    model = _model(arch, "lse", dtype)
    alone = _scores(model, GroupedBatch.from_sequences(a), slice(0, 4))
    trie = GroupedBatch.from_sequences(b + a + c)
    assert trie.layout.num_segments > GroupedBatch.from_sequences(a).layout.num_segments
    _assert_bitwise(alone, _scores(model, trie, slice(2, 6)), "in a batch-wide trie sharing its system prompt")
    part = _scores(model, GroupedBatch.from_sequences([a[3], a[1]]), slice(0, 2))
    _assert_bitwise((alone[0][[3, 1]], alone[1][[3, 1]]), part, "split: two of its responses alone")
    for budget in (128, 192):
        lp, ent = flexgroup.stream_logprobs(model, a, budget=budget, return_entropy=True)
        _assert_bitwise(alone, (lp, ent), f"streamed under a budget of {budget}")


def test_keys_centred_on_the_rows_mean_would_not_be_invariant_to_the_trie(monkeypatch):
    """Broken variant: keys centred on the mean of the whole row (what the backend did before issue 43) shift
    every score of A by an amount that depends on the other sequences: the comparison above would see it."""
    from flexgroup.kernels import lse

    def row_mean(k, roots):
        return k - k.mean(dim=2, keepdim=True)

    monkeypatch.setattr(lse_plan, "CHUNK", 8)
    monkeypatch.setattr(lse, "centre_keys", row_mean)
    g = torch.Generator().manual_seed(3)
    system = _ids(g, 21, 5)
    a = _system_prompted(g, system, 30, (30, 45, 12, 21))
    b = _system_prompted(g, system, 17, (9, 40))
    model = _model("llama", "lse", torch.float32)
    alone = _scores(model, GroupedBatch.from_sequences(a), slice(0, 4))
    packed = _scores(model, GroupedBatch.from_sequences(b + a), slice(2, 6))
    assert not torch.equal(alone[0], packed[0])
