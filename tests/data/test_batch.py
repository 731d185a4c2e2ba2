"""GroupedBatch without a model: packing, metadata, log-prob read-back on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from flexgroup import GroupedBatch, Layout

V = 11


def _t(*xs):
    return torch.tensor(xs)


def _reference_logprobs(logits, prompt, resps, start, temperature=1.0):
    """Oracle for hand-made logits of one group starting at physical ``start``."""
    out, pos = [], start + len(prompt)
    for r in resps:
        rows = [start + len(prompt) - 1] + list(range(pos, pos + len(r) - 1))
        lsm = torch.log_softmax(logits[rows] / temperature, -1)
        out.append(lsm.gather(1, r[:, None])[:, 0])
        pos += len(r)
    return out


def test_packing_order_layout_and_positions():
    b = GroupedBatch.from_groups([_t(1, 2, 3), _t(4)], [[_t(5, 6), _t(7)], [_t(8, 9, 10)]])
    assert b.layout == Layout.pack([Layout.group(3, [2, 1]), Layout.group(1, [3])])
    assert b.input_ids.tolist() == [1, 2, 3, 5, 6, 7, 4, 8, 9, 10]
    inputs = b.model_inputs()
    assert inputs["input_ids"].shape == (1, 10) and inputs["use_cache"] is False
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 3]]
    assert inputs["attention_mask"].shape == (1, 1, 10, 10)
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    assert b.response_lengths == [2, 1, 3] and b.group_of_response.tolist() == [0, 0, 1]


def test_first_token_is_read_from_the_last_prompt_position_not_the_previous_response():
    prompt, resps = _t(1, 2, 3), [_t(4, 5), _t(6, 7, 8)]
    b = GroupedBatch.from_groups([prompt], [resps])
    logits = torch.randn(1, b.num_tokens, V, generator=torch.Generator().manual_seed(0))
    lp = b.logprobs(logits)
    # response 1's first token (6) must come from position 2 (last prompt token) ...
    want = torch.log_softmax(logits[0, 2], -1)[6]
    # ... and not from position 4, the last token of response 0 (a known bug in a ported implementation)
    wrong = torch.log_softmax(logits[0, 4], -1)[6]
    assert torch.isclose(lp[1, 0], want, rtol=0, atol=1e-6) and not torch.isclose(lp[1, 0], wrong)
    for i, ref in enumerate(_reference_logprobs(logits[0], prompt, resps, 0)):
        torch.testing.assert_close(lp[i, : len(ref)], ref)
        assert (lp[i, len(ref):] == 0).all()


def test_logprobs_of_several_groups_chunked_with_temperature_and_entropy():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (4, 1, 6)]
    resps = [[torch.randint(0, V, (n,), generator=g) for n in ns] for ns in ([3, 1], [5], [2, 2, 4])]
    b = GroupedBatch.from_groups(prompts, resps)
    logits = torch.randn(1, b.num_tokens, V, generator=g, dtype=torch.float64)
    lp, ent = b.logprobs(logits, temperature=0.6, return_entropy=True, chunk_size=3)
    assert lp.dtype == torch.float64
    torch.testing.assert_close(lp, b.logprobs(logits, temperature=0.6))  # chunking changes nothing
    k = 0
    starts = [0, 4 + 3 + 1, 4 + 3 + 1 + 1 + 5]  # physical start of each group
    for p, rs, start in zip(prompts, resps, starts):
        for ref in _reference_logprobs(logits[0], p, rs, start, temperature=0.6):
            torch.testing.assert_close(lp[k, : len(ref)], ref)
            k += 1
    # entropy of the first prediction of response 0: from the last prompt position
    q = torch.log_softmax(logits[0, 3] / 0.6, -1)
    torch.testing.assert_close(ent[0, 0], -(q.exp() * q).sum())


def test_logprobs_of_half_precision_logits_are_float32():
    b = GroupedBatch.from_groups([_t(1, 2)], [[_t(3)]])
    assert b.logprobs(torch.randn(1, 3, V).to(torch.bfloat16)).dtype == torch.float32


def test_logprobs_gradient_flows_only_to_predicting_rows():
    b = GroupedBatch.from_groups([_t(1, 2, 3)], [[_t(4, 5), _t(6)]])
    logits = torch.randn(1, b.num_tokens, V, requires_grad=True)
    b.logprobs(logits).sum().backward()
    used = logits.grad[0].abs().sum(-1) > 0
    # rows 2 (last prompt, predicts both first tokens) and 3 (predicts 5); never 0, 1, 4, 5
    assert used.tolist() == [False, False, True, True, False, False]


def test_wrong_logits_shape_is_refused():
    b = GroupedBatch.from_groups([_t(1, 2)], [[_t(3)]])
    with pytest.raises(ValueError, match=r"expected logits \[1, 3, V\]"):
        b.logprobs(torch.randn(1, 4, V))


# --------------------------------------------------------------------------- from_padded
def _padded(rows_p, rows_c, Lp=5, Lc=4, pad=9):
    n = len(rows_p)
    pid, pm = torch.full((n, Lp), pad), torch.zeros(n, Lp, dtype=torch.long)
    cid, cm = torch.full((n, Lc), pad), torch.zeros(n, Lc, dtype=torch.long)
    for i, (p, c) in enumerate(zip(rows_p, rows_c)):
        pid[i, Lp - len(p):], pm[i, Lp - len(p):] = p, 1
        cid[i, : len(c)], cm[i, : len(c)] = c, 1
    return pid, pm, cid, cm


def test_from_padded_consecutive_groups_align_with_completion_rows():
    P, Q = _t(1, 2, 3), _t(4, 5)
    rows_c = [_t(6), _t(7, 8), _t(1, 1, 1, 1), _t(2)]
    pid, pm, cid, cm = _padded([P, P, Q, Q], rows_c)
    b = GroupedBatch.from_padded(pid, pm, cid, cm, group_size=2)
    assert b.layout == Layout.pack([Layout.group(3, [1, 2]), Layout.group(2, [4, 1])])
    assert torch.equal(b.response_mask, cm.bool())
    logits = torch.randn(1, b.num_tokens, V)
    lp = b.logprobs(logits)
    assert lp.shape == (4, 4)
    ref = _reference_logprobs(logits[0], Q, rows_c[2:], 6)
    torch.testing.assert_close(lp[2], ref[0])


def test_from_padded_group_ids_are_authoritative_and_may_interleave():
    P, Q = _t(1, 2, 3), _t(4, 5)
    rows_c = [_t(6), _t(7), _t(8), _t(3)]
    pid, pm, cid, cm = _padded([P, Q, P, P], rows_c)
    b = GroupedBatch.from_padded(pid, pm, cid, cm, group_ids=torch.tensor([0, 1, 0, 2]))
    # equal prompts with different ids (rows 2 and 3... row 3 is its own group) are never merged
    assert b.layout == Layout.pack([Layout.group(3, [1, 1]), Layout.group(2, [1]), Layout.group(3, [1])])
    logits = torch.randn(1, b.num_tokens, V)
    lp = b.logprobs(logits)
    # row 1 (group 1) is packed third but read back in its own row
    torch.testing.assert_close(lp[1, 0], torch.log_softmax(logits[0, 5 + 1], -1)[7])


def test_from_padded_mismatched_prompts_in_a_group_name_the_group():
    pid, pm, cid, cm = _padded([_t(1, 2, 3), _t(1, 2, 4), _t(5), _t(5)], [_t(6)] * 4)
    with pytest.raises(ValueError, match="group 0 mixes different prompts"):
        GroupedBatch.from_padded(pid, pm, cid, cm, group_size=2)
    with pytest.raises(ValueError, match="group 'x' mixes"):
        GroupedBatch.from_padded(pid, pm, cid, cm, group_ids=["y", "y", "x", "x"][::-1])


def test_from_padded_rejects_bad_padding_and_missing_grouping():
    pid, pm, cid, cm = _padded([_t(1, 2)] * 2, [_t(6)] * 2)
    with pytest.raises(ValueError, match="give group_size"):
        GroupedBatch.from_padded(pid, pm, cid, cm)
    with pytest.raises(ValueError, match="positive divisor"):
        GroupedBatch.from_padded(pid, pm, cid, cm, group_size=3)
    bad = pm.clone()
    bad[0] = torch.tensor([1, 0, 0, 1, 1])
    with pytest.raises(ValueError, match="row 0 is not left-padded"):
        GroupedBatch.from_padded(pid, bad, cid, cm, group_size=2)
    bad = cm.clone()
    bad[1] = torch.tensor([0, 1, 0, 0])
    with pytest.raises(ValueError, match="row 1 is not right-padded"):
        GroupedBatch.from_padded(pid, pm, cid, bad, group_size=2)
