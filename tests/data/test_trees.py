"""Trees through the model: token-level prefix tries over whole sequences (issue 10).

Oracle: every sequence alone through a deep copy of the *unpatched* model (stock attention; eager for
Gemma 2), log-probs read from its own logits; the packed size against a set of token prefixes.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexgroup
from flexgroup import GroupedBatch, Layout
from flexgroup.data.batch import micro_batches
from flexgroup.layout.trie import build_trie, plan_micro_batches

VOCAB = 61  # tests/conftest.py's tiny vocabulary


# ---------------------------------------------------------------------------------------------- data
@st.composite
def forests(draw, max_groups: int = 3):
    """Agentic trajectory forests: ``(sequences, loss_masks)``.

    One system prompt shared by every group; per group a task prompt and 1-4 trajectories of 2-4
    turns (assistant tokens in the loss, tool tokens not); later trajectories branch from an earlier
    one at a turn boundary or mid-turn, or are a strict prefix or a duplicate of one; random loss masks.
    """
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))

    def toks(n):
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    def turns(n):  # (tokens, is_assistant) of n fresh turns, the last may end without a tool reply
        t, a = [], []
        for k in range(n):
            n_a, n_t = draw(st.integers(1, 4)), draw(st.integers(0 if k == n - 1 else 1, 3))
            t += toks(n_a) + toks(n_t)
            a += [True] * n_a + [False] * n_t
        return t, a

    system = toks(draw(st.integers(1, 6)))
    seqs, roles = [], []
    for _ in range(draw(st.integers(1, max_groups))):
        base = system + toks(draw(st.integers(1, 4)))
        group: list[tuple[list, list]] = []
        for _ in range(draw(st.integers(1, 4))):
            kind = draw(st.sampled_from(["fresh", "branch_turn", "branch_mid", "prefix", "duplicate"])) \
                if group else "fresh"
            if kind == "fresh":
                t, a = turns(draw(st.integers(2, 4)))
                item = (base + t, [False] * len(base) + a)
            else:
                src_t, src_a = group[draw(st.integers(0, len(group) - 1))]
                if kind == "duplicate":
                    item = (list(src_t), list(src_a))
                elif kind == "prefix":
                    cut = draw(st.integers(2, len(src_t)))
                    item = (src_t[:cut], src_a[:cut])
                else:
                    if kind == "branch_turn":  # after a tool reply (or right after the task prompt)
                        cuts = [len(base)] + [i for i in range(len(base) + 1, len(src_t))
                                              if src_a[i] and not src_a[i - 1]]
                    else:  # inside an assistant message
                        cuts = [i for i in range(len(base) + 1, len(src_t)) if src_a[i] and src_a[i - 1]] or [len(base)]
                    cut = cuts[draw(st.integers(0, len(cuts) - 1))]
                    t, a = turns(draw(st.integers(1, 2)))
                    item = (src_t[:cut] + t, src_a[:cut] + a)
            group.append(item)
        for t, a in group:
            seqs.append(torch.tensor(t))
            m = torch.tensor([x and rng.random() < 0.85 for x in a])
            m[0] = False
            if not m.any():
                m[-1] = True
            roles.append(m)
    return seqs, roles


def distinct_prefixes(seqs) -> int:
    """Independent trie size: the number of distinct non-empty token prefixes."""
    return len({tuple(s[: t + 1].tolist()) for s in seqs for t in range(len(s))})


def alone_logprobs(stock, seqs):
    """Oracle: per sequence, log p(s[t] | s[:t]) for t >= 1 from the stock model run on s alone -> [n - 1]."""
    out = []
    for s in seqs:
        logits = stock(input_ids=s[None], use_cache=False).logits[0]
        out.append(torch.log_softmax(logits[:-1], -1).gather(1, s[1:, None])[:, 0])
    return out


def _weights(n, dtype):
    return torch.linspace(-1.0, 1.5, n, dtype=dtype)


def patched_and_stock(model, oracle):
    """(model patched in training mode, a stock deep copy taken before patching)."""
    model.train()
    stock = oracle.stock_copy(model)
    return flexgroup.patch(model, backend="sdpa"), stock


def check_against_alone(model, stock, seqs, masks, ctx, atol, rel, oracle, batch=None):
    """Grouped log-probs (full and needed-logits paths) and every gradient == each sequence alone."""
    batch = batch or GroupedBatch.from_sequences(seqs, masks)
    with ctx:
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        w = _weights(len(seqs), lp.dtype)
        (lp * w[:, None]).sum().backward()
        refs = alone_logprobs(stock, seqs)
        sum((r * m[1:].to(r.dtype)).sum() * wi for r, m, wi in zip(refs, masks, w)).backward()
        with torch.no_grad():
            lp_needed = batch.logprobs(model(**batch.model_inputs(needed_logits_only=True)).logits)
    assert lp.shape[0] == len(seqs) and lp.shape[1] == batch.max_len >= max(len(s) for s in seqs)
    for i, (s, m, r) in enumerate(zip(seqs, masks, refs)):
        assert batch.response_mask[i, : len(s)].tolist() == m.tolist() and not batch.response_mask[i, len(s):].any()
        torch.testing.assert_close(lp[i, 1: len(s)][m[1:]], r[m[1:]], atol=atol, rtol=0)
        assert (lp[i][~batch.response_mask[i]] == 0).all()
    torch.testing.assert_close(lp_needed, lp.detach(), atol=atol, rtol=0)
    oracle.assert_grads_close(oracle.grads(model), oracle.grads(stock), rel)
    return batch, lp


# ---------------------------------------------------------------------------------------------- the property
ARCHS = ["llama", "qwen2", "qwen3", "gemma2"]  # qwen2/qwen3/gemma2: window 4, shorter than every sequence


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_trajectory_forests_equal_each_sequence_alone(arch, dtype, tiny_model, hf_oracle, precision_for):
    ctx, atol, rel = precision_for(dtype)
    patched0, stock0 = patched_and_stock(tiny_model(arch, dtype), hf_oracle)
    ran: list[int] = []

    @settings(max_examples=10 if dtype == torch.float64 else 6, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(forests())
    def prop(data):
        seqs, masks = data
        ran.append(len(seqs))
        for m in (stock0, patched0):
            m.zero_grad(set_to_none=True)
        batch, _ = check_against_alone(patched0, stock0, seqs, masks, ctx, atol, rel, hf_oracle)
        assert batch.num_tokens == distinct_prefixes(seqs) < sum(len(s) for s in seqs) + 1

    prop()
    assert len(ran) >= 6 and max(ran) >= 4, ran  # the property really ran on multi-sequence forests


def test_the_property_fails_for_plain_causal_attention_over_the_packed_row(tiny_model, hf_oracle, precision_for,
                                                                            causal_over_packed_row):
    # the deliberately broken variant: branches see their siblings; the same check must catch it
    ctx, atol, rel = precision_for(torch.float64)
    model, stock = patched_and_stock(tiny_model("llama", torch.float64), hf_oracle)
    sys_p = torch.tensor([5, 6, 7])
    seqs = [torch.cat([sys_p, torch.tensor([8, 9, 10])]), torch.cat([sys_p, torch.tensor([11, 12])])]
    with pytest.raises(AssertionError):
        check_against_alone(model, stock, seqs, [torch.arange(len(s)) >= 3 for s in seqs], ctx, atol, rel, hf_oracle)


# ---------------------------------------------------------------------------------------------- structure
def test_trie_shares_every_common_prefix_and_branches_mid_segment():
    a = torch.tensor([1, 2, 3, 4, 5])
    b = torch.tensor([1, 2, 3, 9])        # branches after 3 tokens
    c = torch.tensor([1, 2])              # strict prefix: ends inside the shared segment, no split
    d = a.clone()                         # duplicate
    e = torch.tensor([7, 8])              # another tree
    batch = GroupedBatch.from_sequences([a, b, c, d, e])
    assert batch.layout == Layout.tree([-1, 0, 0, -1], [3, 2, 1, 2])
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 9, 7, 8]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 0, 1]
    assert batch.num_tokens == distinct_prefixes([a, b, c, d, e]) == 8
    assert batch.group_of_response.tolist() == [0, 0, 0, 0, 1]
    assert batch.response_mask.tolist() == [[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 1, 0, 0, 0], [0, 1, 1, 1, 1],
                                             [0, 1, 0, 0, 0]]
    trie = build_trie([s.tolist() for s in (a, b, c, d, e)])
    assert [p.tolist() for p in trie.paths] == [[0, 1, 2, 3, 4], [0, 1, 2, 5], [0, 1], [0, 1, 2, 3, 4], [6, 7]]
    assert trie.tree_tokens == (6, 2) and trie.tree_of == (0, 0, 0, 0, 1)


def test_first_token_after_a_branch_is_read_from_the_ancestor_not_the_previous_branch():
    a, b = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 2, 3, 9, 6])
    batch = GroupedBatch.from_sequences([a, b])
    logits = torch.randn(1, batch.num_tokens, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lp = batch.logprobs(logits)
    # b's token 9 (packed index 5) follows 3 (packed index 2), not 5 (packed index 4, the end of a)
    want = torch.log_softmax(logits[0, 2], -1)[9]
    wrong = torch.log_softmax(logits[0, 4], -1)[9]
    assert torch.isclose(lp[1, 3], want, atol=1e-12, rtol=0) and not torch.isclose(lp[1, 3], wrong, atol=1e-3)
    for i, s in enumerate((a, b)):
        path = batch.layout.paths()[i]
        ref = torch.log_softmax(logits[0, path[:-1]], -1).gather(1, s[1:, None])[:, 0]
        torch.testing.assert_close(lp[i, 1:], ref, atol=1e-12, rtol=0)
    assert batch.logit_rows.tolist() == [0, 1, 2, 3, 5]  # the last token of each leaf predicts nothing
    lp_e, ent = batch.logprobs(logits, return_entropy=True)
    q = torch.log_softmax(logits[0, 2], -1)
    assert torch.equal(lp_e, lp) and torch.isclose(ent[1, 3], -(q.exp() * q).sum(), atol=1e-12) and ent[0, 0] == 0


def test_from_groups_and_from_padded_keep_their_layout_and_outputs(groups):
    prompts, responses = groups([(5, [3, 1]), (2, [4])], seed=3)
    b = GroupedBatch.from_groups(prompts, responses)
    assert b.layout == Layout.pack([Layout.group(5, [3, 1]), Layout.group(2, [4])])
    assert b.response_lengths == [3, 1, 4] and b.max_len == 4 and b.group_of_response.tolist() == [0, 0, 1]
    # the same numbers as the trie over [P; R_i] with the loss on R_i, shifted by len(P)
    seqs = [torch.cat([p, r]) for p, rs in zip(prompts, responses) for r in rs]
    plen = [len(p) for p, rs in zip(prompts, responses) for _ in rs]
    t = GroupedBatch.from_sequences(seqs, [torch.arange(len(s)) >= n for s, n in zip(seqs, plen)])
    logits = torch.randn(1, b.num_tokens, VOCAB, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # the trie merges a one-response group into one segment; same row, same positions, same paths
    assert torch.equal(t.input_ids, b.input_ids) and torch.equal(t.position_ids, b.position_ids)
    assert all(torch.equal(x, y) for x, y in zip(t.paths, b.paths)) and t.num_tokens == distinct_prefixes(seqs)
    lp_b, lp_t = b.logprobs(logits), t.logprobs(logits)
    for i, n in enumerate(plen):
        torch.testing.assert_close(lp_t[i, n: n + b.response_lengths[i]], lp_b[i, : b.response_lengths[i]],
                                   atol=1e-12, rtol=0)


def test_from_layout_reads_along_the_layouts_paths(tiny_model, hf_oracle, precision_for):
    ctx, atol, rel = precision_for(torch.float64)
    model, stock = patched_and_stock(tiny_model("qwen3", torch.float64), hf_oracle)
    lay = Layout.pack([Layout.tree([-1, 0, 0, 2, 2], [4, 3, 2, 2, 5]), Layout.group(3, [2])])
    ids = torch.randint(1, VOCAB, (lay.num_tokens,), generator=torch.Generator().manual_seed(2))
    loss = torch.rand(lay.num_tokens, generator=torch.Generator().manual_seed(3)) < 0.7
    loss[[lay.starts[s] + 1 for s in lay.roots]] = True  # every path scores something
    batch = GroupedBatch.from_layout(lay, ids, loss)
    assert batch.layout is lay and batch.num_responses == len(lay.paths()) == 4
    seqs = [ids[p] for p in lay.paths()]
    masks = []
    for p in lay.paths():
        m = loss[p].clone()
        m[0] = False
        masks.append(m)
    check_against_alone(model, stock, seqs, masks, ctx, atol, rel, hf_oracle, batch=batch)


def test_from_padded_sequences_with_trl_completion_and_tool_masks(tiny_model, hf_oracle, precision_for):
    ctx, atol, rel = precision_for(torch.float64)
    model, stock = patched_and_stock(tiny_model("llama", torch.float64), hf_oracle)
    g = torch.Generator().manual_seed(4)
    prompt, turn1 = torch.randint(1, VOCAB, (6,), generator=g), torch.randint(1, VOCAB, (4,), generator=g)
    rows = [torch.cat([prompt, turn1, torch.randint(1, VOCAB, (n,), generator=g)]) for n in (5, 2, 7)]
    L = 20
    ids = torch.zeros(3, L, dtype=torch.long)
    am, cm, tm = (torch.zeros(3, L, dtype=torch.long) for _ in range(3))
    for i, r in enumerate(rows):
        ids[i, : len(r)], am[i, : len(r)], cm[i, 6: len(r)] = r, 1, 1
    tm[:] = 1
    tm[:, 8:10] = 0  # a tool reply inside the completion
    batch = GroupedBatch.from_padded_sequences(ids, am, completion_mask=cm, tool_mask=tm)
    assert batch.max_len == L and batch.response_mask.tolist() == (cm.bool() & tm.bool()).tolist()
    assert batch.num_tokens == 6 + 4 + 5 + 2 + 7
    masks = [(cm.bool() & tm.bool())[i, : len(r)] for i, r in enumerate(rows)]
    check_against_alone(model, stock, rows, masks, ctx, atol, rel, hf_oracle, batch=batch)
    same = GroupedBatch.from_padded_sequences(ids, am, loss_mask=cm * tm)
    assert torch.equal(same.response_mask, batch.response_mask) and same.layout == batch.layout


# ---------------------------------------------------------------------------------------------- micro-batches
def test_micro_batches_pack_whole_trees_first_fit_decreasing_and_say_where_each_sequence_went():
    # decreasing: 9 -> row A, 5 -> row B, 4 -> B, 3 -> row C (A has 1 left, B 1), 1 -> A
    assert plan_micro_batches([5, 9, 3, 4, 1], 10) == [[0, 3], [1, 4], [2]]
    g = torch.Generator().manual_seed(5)
    trees = [torch.randint(1, VOCAB, (n,), generator=g) for n in (6, 3, 8, 2)]
    seqs = []
    for k, p in enumerate(trees):  # tree k: prompt p (its own first token) and 2 continuations
        p[0] = k + 1
        seqs += [torch.cat([p, torch.randint(1, VOCAB, (k + 1,), generator=g)]) for _ in range(2)]
    seqs = [seqs[i] for i in (3, 0, 6, 1, 4, 7, 2, 5)]  # members of a tree scattered over the list
    whole = GroupedBatch.from_sequences(seqs)
    sizes = [distinct_prefixes([s for s in seqs if s[0] == k + 1]) for k in range(4)]
    mb = micro_batches(seqs, budget=max(sizes) + 3)
    assert sum(b.num_tokens for b in mb.batches) == whole.num_tokens == sum(sizes)
    assert all(b.num_tokens <= max(sizes) + 3 for b in mb.batches) and len(mb.batches) < 4
    for k, s in enumerate(seqs):
        b, i = mb.where[k]
        assert torch.equal(mb.batches[b].input_ids[mb.batches[b].paths[i]], s)
    with pytest.raises(ValueError, match=r"tree 2 \(sequences 2, 5; 2 in all\) needs 10 tokens .* budget is 9"):
        micro_batches(seqs, budget=9)


# ---------------------------------------------------------------------------------------------- bad input
_S = torch.tensor([3, 4, 5])


@pytest.mark.parametrize("call,message", [
    (lambda: GroupedBatch.from_sequences([]), "no sequences given"),
    (lambda: GroupedBatch.from_sequences([_S, torch.tensor([], dtype=torch.long)]), "sequence 1 is empty"),
    (lambda: GroupedBatch.from_sequences([_S, torch.tensor([[1, 2]])]), r"sequence 1 must be a 1-D integer tensor"),
    (lambda: GroupedBatch.from_sequences([torch.tensor([1.0, 2.0])]), r"sequence 0 must be a 1-D integer .*float"),
    (lambda: GroupedBatch.from_sequences(torch.ones(2, 3, dtype=torch.long)), "use from_padded_sequences"),
    (lambda: GroupedBatch.from_sequences([_S, _S], [torch.tensor([0, 1, 1]).bool()]), "1 loss masks for 2 sequences"),
    (lambda: GroupedBatch.from_sequences([_S, _S], [torch.tensor([0, 1, 1]).bool(), torch.tensor([0, 1]).bool()]),
     r"loss mask of sequence 1 must be .* length 3"),
    (lambda: GroupedBatch.from_sequences([_S, _S], [torch.tensor([0, 1, 1]).bool(), torch.zeros(3, dtype=torch.bool)]),
     "loss mask of sequence 1 is all False"),
    (lambda: GroupedBatch.from_sequences([_S], [torch.tensor([1, 1, 1]).bool()]), "sequence 0 is True at position 0"),
    (lambda: GroupedBatch.from_sequences([_S], [torch.tensor([0.0, 0.5, 1.0])]),
     r"loss mask of sequence 0 holds values other than 0/1 \(0.5\)"),
    (lambda: GroupedBatch.from_layout(Layout.group(2, [2]), torch.arange(5)), "input_ids has 5 tokens but the layout has 4"),
    (lambda: GroupedBatch.from_layout(Layout.group(2, [2]), torch.zeros(4)), "must be a 1-D integer tensor"),
    (lambda: GroupedBatch.from_layout(Layout.group(2, [1, 1]), torch.arange(4), torch.tensor([1, 0, 1, 0]).bool()),
     r"path 1 \(leaf segment 2\) is all False"),
    (lambda: GroupedBatch.from_layout(Layout.group(2, [2]), torch.arange(4), torch.ones(3, dtype=torch.bool)),
     "loss_mask must be a 1-D bool tensor of 4 entries"),
    (lambda: GroupedBatch.from_padded_sequences(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 0, 1], [1, 1, 1]])),
     "attention_mask row 0 is not right-padded"),
    (lambda: GroupedBatch.from_padded_sequences(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [1, 1, 1]]),
                                                torch.tensor([[0, 1, 1], [0, 1, 1]])), "row 0 is True on padding"),
    (lambda: GroupedBatch.from_padded_sequences(torch.ones(2, 3, dtype=torch.long), tool_mask=torch.ones(2, 3)),
     "tool_mask needs completion_mask"),
    (lambda: GroupedBatch.from_padded_sequences(torch.ones(2, 3, dtype=torch.long), completion_mask=torch.ones(2, 2)),
     r"completion_mask has shape \(2, 2\)"),
    (lambda: micro_batches([_S], budget=0), "budget must be a positive number of tokens"),
    (lambda: micro_batches([_S, torch.tensor([3, 4, 9])], budget=3), r"tree 0 \(sequences 0, 1; 2 in all\) needs 4 tokens"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_raises_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_path_beyond_the_position_limit_raises_but_a_long_row_of_short_paths_does_not(tiny_model):
    model = flexgroup.patch(tiny_model("llama", max_position_embeddings=16), backend="sdpa")
    g = torch.Generator().manual_seed(6)
    shared = torch.randint(1, VOCAB, (8,), generator=g)
    ok = GroupedBatch.from_sequences([torch.cat([shared, torch.randint(1, VOCAB, (8,), generator=g)]) for _ in range(4)])
    assert ok.num_tokens == 40 > 16
    model(**ok.model_inputs())  # every path has 16 tokens: positions 0..15
    long = GroupedBatch.from_sequences([torch.cat([shared, torch.randint(1, VOCAB, (9,), generator=g)]), shared])
    with pytest.raises(ValueError, match="virtual position 16"):
        model(**long.model_inputs())


def test_ids_outside_the_vocabulary_fail_as_in_the_stock_model(tiny_model):
    stock = tiny_model("llama")
    model = flexgroup.patch(tiny_model("llama"), backend="sdpa")
    bad = torch.tensor([1, 2, VOCAB + 3])
    with pytest.raises(IndexError) as stock_err:
        stock(input_ids=bad[None])
    with pytest.raises(IndexError) as grouped_err:
        model(**GroupedBatch.from_sequences([bad, torch.tensor([1, 2, 7])]).model_inputs())
    assert type(stock_err.value) is type(grouped_err.value)


def _join(*pieces):
    """Concatenate test_vl ``Prompt`` pieces into one sequence: (ids [n], its visual inputs or None)."""
    ids = torch.tensor([t for p in pieces for t in p.ids])
    vision: dict = {}
    for p in pieces:
        for k, xs in p.vision.items():
            vision.setdefault(k, []).extend(xs)
    v = {k: (torch.tensor(x) if k == "second_per_grid_ts" else torch.cat(x)) for k, x in vision.items()}
    if pieces[0].kind != "qwen2_5_vl":
        v.pop("second_per_grid_ts", None)
    return ids, (v or None)


def vl_trajectories(kind: str):
    """A Qwen-VL tree: an image in the shared system prompt, screenshots in later tool replies (one
    shared by two branches, one with the same placeholder tokens but other pixels), a video, a
    strict prefix; -> sequences, visual inputs, loss masks."""
    from test_vl import Prompt

    g = torch.Generator().manual_seed(9)

    def P():
        return Prompt(kind, g)

    system = P().text(3).image(4, 4).text(2)
    turn1 = P().text(3)                                   # assistant
    shot = P().text(2).image(4, 4).text(1)                # tool reply with a screenshot
    other = P()                                           # same tokens, different pixels
    other.ids = list(shot.ids)
    other.vision = {"pixel_values": [torch.randn_like(shot.vision["pixel_values"][0])],
                    "image_grid_thw": list(shot.vision["image_grid_thw"])}
    clip = P().text(1).video(2, 4, 4).text(1)
    pieces = [(system, turn1, shot, P().text(4)),
              (system, turn1, shot, P().text(2), P().text(1).image(4, 6).text(1), P().text(3)),
              (system, turn1, other, P().text(3)),
              (system, P().text(2), clip, P().text(2)),
              (system, turn1, shot)]                      # a strict prefix of the first two
    seqs, vision = zip(*(_join(*p) for p in pieces))
    n_sys = len(system.ids)
    masks = [(torch.arange(len(s)) >= n_sys) & (s < 100) for s in seqs]  # text after the system prompt
    return list(seqs), list(vision), masks


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vision_language_trees_equal_each_sequence_alone(kind, hf_oracle, precision_for):
    from test_vl import _stock_inputs, make_vl
    from flexgroup.data.multimodal import MultimodalGroupedBatch

    ctx, atol, rel = precision_for(torch.float64)
    model, stock = patched_and_stock(make_vl(kind, torch.float64), hf_oracle)
    seqs, vision, masks = vl_trajectories(kind)
    batch = MultimodalGroupedBatch.from_sequences(seqs, masks, model=model, vision=vision)
    # system image once, the shared screenshot once, the other-pixels screenshot, the later image: 4 images
    assert batch.vision_inputs["image_grid_thw"].shape[0] == 4
    # 'other' has the screenshot's token ids but other pixels: not merged from its first placeholder on
    keyed = [x.clone() for x in seqs]
    keyed[2][torch.nonzero(keyed[2] == 120)[4:, 0]] = -1  # placeholders after the system image (4 of them)
    assert batch.num_tokens == distinct_prefixes(keyed) > distinct_prefixes(seqs)
    w = _weights(len(seqs), torch.float64)
    with ctx:
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        (lp * w[:, None]).sum().backward()
        for i, (s, v, m, wi) in enumerate(zip(seqs, vision, masks, w)):
            logits = stock(**_stock_inputs(stock, s, s[:0], v)).logits[0]
            ref = torch.log_softmax(logits[:-1], -1).gather(1, s[1:, None])[:, 0]
            (ref * m[1:].to(ref.dtype)).sum().mul(wi).backward()
            torch.testing.assert_close(lp[i, 1: len(s)][m[1:]], ref[m[1:]], atol=atol, rtol=0)
    got, want = hf_oracle.grads(model), hf_oracle.grads(stock)
    assert any(n.startswith("model.visual.") and want[n].abs().max() > 0 for n in want)
    hf_oracle.assert_grads_close(got, want, rel)


def test_vision_language_trees_refuse_what_they_cannot_pack():
    from test_vl import make_vl
    from flexgroup.data.multimodal import MultimodalGroupedBatch

    model = make_vl("qwen2_vl")
    seqs, vision, masks = vl_trajectories("qwen2_vl")
    with pytest.raises(ValueError, match="sequence 1 has 14 image placeholder tokens .* gives 8"):
        MultimodalGroupedBatch.from_sequences(seqs[:2], model=model, vision=[vision[0], vision[0]])
    # Qwen3-VL splits a video into frames separated by text: the same video with different text between its
    # frames would branch inside the video (one feature set, two placeholder runs): refused, never wrong
    from test_vl import TS, VE, VID, VS

    video = {"pixel_values_videos": torch.randn(32, 24), "video_grid_thw": torch.tensor([[2, 4, 4]])}
    frame = [VS] + [VID] * 4 + [VE]
    a, b = torch.tensor([5, TS] + frame + [TS] + frame + [6]), torch.tensor([5, TS] + frame + [7] + frame + [6])
    with pytest.raises(ValueError, match="sequence 1: the placeholders of one visual item are split"):
        MultimodalGroupedBatch.from_sequences([a, b], model=make_vl("qwen3_vl"), vision=[video, video])
    for how in ("from_padded_sequences", "from_layout"):
        with pytest.raises(NotImplementedError, match=f"{how} is not implemented: pass whole sequences"):
            getattr(MultimodalGroupedBatch, how)([_S])


def test_text_only_trees_on_a_qwen_vl_model_equal_each_sequence_alone(hf_oracle, precision_for):
    from test_vl import make_vl  # the tiny Qwen-VL builder of tests/patches/test_vl.py

    ctx, atol, rel = precision_for(torch.float64)
    model, stock = patched_and_stock(make_vl("qwen2_vl", torch.float64), hf_oracle)
    g = torch.Generator().manual_seed(7)
    sys_p = torch.randint(3, 100, (6,), generator=g)  # ids below the vision placeholders (120-124)
    seqs = [torch.cat([sys_p, torch.randint(3, 100, (n,), generator=g)]) for n in (4, 7, 2)]
    seqs.append(torch.cat([seqs[1][:9], torch.randint(3, 100, (3,), generator=g)]))
    check_against_alone(model, stock, seqs, [torch.arange(len(s)) >= 6 for s in seqs], ctx, atol, rel, hf_oracle)


def test_from_padded_share_trie_shares_what_completions_have_in_common(tiny_model, hf_oracle, precision_for):
    ctx, atol, rel = precision_for(torch.float64)
    model, stock = patched_and_stock(tiny_model("qwen2", torch.float64), hf_oracle)
    g = torch.Generator().manual_seed(8)
    turn = torch.randint(1, VOCAB, (5,), generator=g)  # an earlier turn both completions of group 0 repeat
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (4, 4, 6)]
    prompts[1] = prompts[0]
    comps = [torch.cat([turn, torch.randint(1, VOCAB, (n,), generator=g)]) for n in (3, 1)] + \
        [torch.randint(1, VOCAB, (4,), generator=g)]
    pid, pm = torch.zeros(3, 6, dtype=torch.long), torch.zeros(3, 6, dtype=torch.long)
    cid, cm = torch.zeros(3, 9, dtype=torch.long), torch.zeros(3, 9, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        pid[i, 6 - len(p):], pm[i, 6 - len(p):], cid[i, : len(c)], cm[i, : len(c)] = p, 1, c, 1
    trie = GroupedBatch.from_padded(pid, pm, cid, cm, share="trie")
    groups = GroupedBatch.from_padded(pid, pm, cid, cm, group_ids=[0, 0, 1])
    assert trie.num_tokens == groups.num_tokens - 5 and torch.equal(trie.response_mask, groups.response_mask)
    seqs = [torch.cat([p, c]) for p, c in zip(prompts, comps)]
    lps = []
    for batch in (trie, groups):
        model.zero_grad(set_to_none=True)
        with ctx:
            lp = batch.logprobs(model(**batch.model_inputs(needed_logits_only=True)).logits)
            (lp * _weights(3, lp.dtype)[:, None]).sum().backward()
        lps.append((lp.detach(), hf_oracle.grads(model)))
    with ctx:  # the oracle: each [prompt; completion] alone
        refs = alone_logprobs(stock, seqs)
        sum(r[len(p) - 1:].sum() * w for r, p, w in zip(refs, prompts, _weights(3, torch.float64))).backward()
    for lp, grads in lps:
        for i, (p, c) in enumerate(zip(prompts, comps)):
            torch.testing.assert_close(lp[i, : len(c)], refs[i][len(p) - 1:], atol=atol, rtol=0)
        hf_oracle.assert_grads_close(grads, hf_oracle.grads(stock), rel)
    with pytest.raises(ValueError, match="drop group_size/group_ids"):
        GroupedBatch.from_padded(pid, pm, cid, cm, group_size=3, share="trie")


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
def test_trees_with_lora_and_gradient_checkpointing(tiny_model, hf_oracle, precision_for):
    peft = pytest.importorskip("peft")
    # float32: conftest's float64 mode (norms kept in float64) is not active when checkpointing recomputes
    ctx, atol, rel = precision_for(torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           init_lora_weights=False)
    model, stock = patched_and_stock(peft.get_peft_model(tiny_model("qwen3", torch.float32), lora), hf_oracle)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seqs, masks = _fixed_forest()
    check_against_alone(model, stock, seqs, masks, ctx, atol, rel, hf_oracle)
    assert any("lora" in n for n in hf_oracle.grads(model))


def _fixed_forest():
    """A small trajectory forest: a shared system prompt, two groups, a mid-turn branch, a prefix."""
    g = torch.Generator().manual_seed(10)

    def r(n):
        return torch.randint(1, VOCAB, (n,), generator=g)

    sys_p, t1, t2 = r(5), r(3), r(2)
    a = torch.cat([sys_p, t1, r(4), r(3)])
    b = torch.cat([a[:10], r(5)])              # branches inside the second turn
    c = a[:9]                                  # a strict prefix
    d = torch.cat([sys_p, t2, r(6)])           # another group
    seqs = [a, b, c, d]
    return seqs, [torch.arange(len(s)) >= 5 for s in seqs]


@pytest.mark.parametrize("arch", ["olmo2", "mistral"])
def test_trees_on_the_generic_path_and_mistral_windows(arch, tiny_model, hf_oracle, precision_for):
    ctx, atol, rel = precision_for(torch.float64)
    model, stock = patched_and_stock(tiny_model(arch, torch.float64), hf_oracle)
    check_against_alone(model, stock, *_fixed_forest(), ctx, atol, rel, hf_oracle)
