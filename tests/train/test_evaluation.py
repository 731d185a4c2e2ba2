"""Multiple-choice / log-likelihood evaluation == each [context; continuation] alone through the stock model.

Requests mimic a few-shot multiple-choice task: every context starts with the same few-shot block,
questions differ, each has 4 choices (one of them the stock model's greedy continuation, so both
is_greedy values occur), plus a request whose context is a prefix of another's. Oracles: each
request alone through an unpatched copy (float64 and float32), and lm-evaluation-harness's own
``HFLM`` on the same checkpoint (when lm-eval is installed).
"""

from __future__ import annotations

import pytest
import torch

from flexgroup.train import evaluation

from _trainers import LETTERS, save_tiny_llama, word_tokenizer

VOCAB = 61


def _greedy(stock, ctx, n):
    ids = ctx.clone()
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, stock(input_ids=ids[None], use_cache=False).logits[0, -1].argmax()[None]])
    return ids[len(ctx):]


def _task(stock, seed=0):
    g = torch.Generator().manual_seed(seed)
    shots = torch.randint(1, VOCAB, (24,), generator=g)
    questions = []
    for q, qlen in enumerate((5, 9, 3)):
        ctx = torch.cat([shots, torch.randint(1, VOCAB, (qlen,), generator=g)])
        choices = [torch.randint(1, VOCAB, (n,), generator=g) for n in (1, 3, 2)]
        choices.append(_greedy(stock, ctx, 1 + q))
        questions.append((ctx, choices))
    questions.append((shots[:10], [torch.randint(1, VOCAB, (4,), generator=g)]))   # context = prefix of the others
    return questions


def _oracle(stock, pairs):
    out = []
    with torch.no_grad():
        for ctx, cont in pairs:
            logits = stock(input_ids=torch.cat([ctx, cont])[None], use_cache=False).logits[0]
            pred = logits[len(ctx) - 1: len(ctx) + len(cont) - 1]
            lp = torch.log_softmax(pred, -1).gather(1, cont[:, None])[:, 0].sum()
            out.append((float(lp), bool((pred.argmax(-1) == cont).all())))
    return out


def _check(got, ref, atol):
    assert len(got) == len(ref)
    for k, ((a, ga), (b, gb)) in enumerate(zip(got, ref)):
        assert abs(a - b) <= atol, f"request {k}: log-likelihood {a!r} vs stock {b!r}"
        assert ga == gb, f"request {k}: is_greedy {ga} vs stock {gb}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_multiple_choice_equals_stock(arch, dtype, tiny_model, hf_oracle, precision_for):
    ctx_mode, atol, _ = precision_for(dtype)
    model = tiny_model(arch, dtype)
    stock = hf_oracle.stock_copy(model)
    questions = _task(stock)
    pairs = [(c, x) for c, xs in questions for x in xs]
    with ctx_mode:
        ref = _oracle(stock, pairs)
        got = evaluation.multiple_choice(model, questions)
        small = evaluation.loglikelihood(model, pairs, max_tokens=40)     # several rows, shared tree split
    assert any(g for _, g in ref) and not all(g for _, g in ref)
    flat = [r for per_q in got for r in per_q]
    _check(flat, ref, atol * 10)
    _check(small, ref, atol * 10)
    assert [len(r) for r in got] == [len(xs) for _, xs in questions]


def test_shared_few_shot_prefix_is_encoded_once(tiny_model, hf_oracle):
    from flexgroup.train.scoring import score_sequences

    model = tiny_model("llama")
    questions = _task(hf_oracle.stock_copy(model))
    seqs = [torch.cat([c, x]) for c, xs in questions for x in xs]
    starts = [len(c) for c, xs in questions for _ in xs]
    with torch.no_grad():
        res = score_sequences(model, seqs, starts, max_tokens=None, temperature=1.0, backend="sdpa")
    # trie nodes of the inputs (a sequence's last token is only predicted, never fed)
    distinct = len({tuple(s[:i + 1].tolist()) for s in seqs for i in range(len(s) - 1)})
    assert res.rows == 1 and res.grouped_tokens == distinct < res.baseline_tokens / 3
    assert res.baseline_tokens == sum(len(s) - 1 for s in seqs)


def test_wrong_row_is_caught(tiny_model, hf_oracle, monkeypatch):
    """Broken variant: each request reads the scores of its neighbour in the packed row."""
    model = tiny_model("llama")
    stock = hf_oracle.stock_copy(model)
    pairs = [(c, x) for c, xs in _task(stock) for x in xs]
    ref = _oracle(stock, pairs)
    from flexgroup.train import scoring

    real = scoring._token_scores
    monkeypatch.setattr(scoring, "_token_scores",
                        lambda logits, index, *args: real(logits, index.roll(1, 0), *args))
    with pytest.raises(AssertionError, match="request"):
        _check(evaluation.loglikelihood(model, pairs), ref, 1e-4)


def test_string_requests_and_errors(tiny_model, hf_oracle):
    tok = word_tokenizer()
    model = tiny_model("llama")
    stock = hf_oracle.stock_copy(model)
    reqs = [("a b c d", " e f"), ("a b c d ", "g"), ("a b", " c")]
    ids = [tuple(torch.tensor(t) for t in evaluation.encode_pair(tok, c, x)) for c, x in reqs]
    assert [len(c) for c, _ in ids] == [4, 4, 2] and [len(x) for _, x in ids] == [2, 1, 1]
    _check(evaluation.loglikelihood(model, reqs, tokenizer=tok), _oracle(stock, ids), 1e-5)
    with pytest.raises(ValueError, match="tokenizer"):
        evaluation.loglikelihood(model, reqs)
    with pytest.raises(ValueError, match="context is empty"):
        evaluation.encode_pair(tok, "", "a")
    with pytest.raises(ValueError, match="continuation of request 0"):
        evaluation.loglikelihood(model, [([1, 2], [])])


# ------------------------------------------------------------------ lm-evaluation-harness
@pytest.fixture(scope="module")
def lm_eval_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_eval"), max_positions=64)


def test_lm_eval_model_matches_stock_hflm(lm_eval_dir, monkeypatch):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'flexgroup[eval]')")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM

    import flexgroup.integrations.lm_eval as fg_eval

    cls = get_model("flexgroup")
    assert cls is fg_eval.FlexGroupLM
    common = dict(pretrained=lm_eval_dir, device="cpu", dtype="float32", batch_size=3, max_length=40)
    ours = cls(max_tokens=64, **common)
    stock = HFLM(**common)
    g = torch.Generator().manual_seed(4)
    shots = " ".join(LETTERS[int(i)] for i in torch.randint(0, 26, (20,), generator=g))
    reqs = []
    for q in range(3):
        ctx = shots + " " + " ".join(LETTERS[int(i)] for i in torch.randint(0, 26, (3 + 2 * q,), generator=g))
        for c in range(4):
            cont = " " + " ".join(LETTERS[int(i)] for i in torch.randint(0, 26, (1 + c,), generator=g))
            reqs.append(Instance("loglikelihood", {}, (ctx, cont), len(reqs)))
    reqs.append(Instance("loglikelihood", {}, (shots + " " + shots, " a b"), len(reqs)))    # left-truncated (> 40)
    # the stock model's greedy next token as one continuation: is_greedy True somewhere
    ids = stock.tok_encode(shots)
    nxt = int(stock.model(torch.tensor([ids])).logits[0, -1].argmax())
    reqs.append(Instance("loglikelihood", {}, (shots, " " + stock.tokenizer.decode([nxt])), len(reqs)))
    got, ref = ours.loglikelihood(reqs), stock.loglikelihood(reqs)
    assert any(gr for _, gr in ref)
    _check(got, ref, 1e-5)
    s = ours.flexgroup_stats
    assert s["grouped_tokens"] < s["baseline_tokens"] / 2, s
    rolling = [Instance("loglikelihood_rolling", {}, (shots + " " + shots,), 0)]
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(stock.loglikelihood_rolling(rolling), abs=1e-4)
    print(f"\nlm-eval: {len(reqs)} requests, {s['grouped_tokens']} grouped tokens vs {s['baseline_tokens']} "
          f"per request, {s['rows']} rows")
