"""flexgroup.score == each [P; R_i] alone through the stock, unpatched model.

Causal LMs: per-token and summed log-probs, is_greedy (some responses are the stock model's own greedy
continuation, so both flag values occur). ``*ForSequenceClassification``: the pooled classification
logits, with responses that end in pad tokens (the stock model pools the last non-pad token, which
can fall inside the prompt). float64 (norms kept in float64) and float32; Llama, Qwen2 and Qwen3 (both
windowed here, window shorter than the prompts), and OLMo 2 classifiers (generic patch path). Broken variants prove the checks can fail.
"""

from __future__ import annotations

import copy

import pytest
import torch

import flexgroup
from flexgroup.train import scoring

ARCHS = ["llama", "qwen2", "qwen3"]
DTYPES = [torch.float64, torch.float32]
SIZES = [(9, [5, 3, 7]), (6, [4, 2]), (1, [6, 2])]


def _greedy_continuation(stock, prompt, n):
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(n):
            nxt = stock(input_ids=ids[None], use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt[None]])
    return ids[len(prompt):]


def _lm_inputs(stock, groups):
    prompts, responses = groups(SIZES, seed=3)
    # the stock model's own greedy continuations: is_greedy must be True for these (and for a prefix)
    responses[0][1] = _greedy_continuation(stock, prompts[0], 4)
    responses[2].append(_greedy_continuation(stock, prompts[2], 1))
    return prompts, responses


def _lm_oracle(stock, prompts, responses):
    lps, greedy = [], []
    with torch.no_grad():
        for p, rs in zip(prompts, responses):
            for r in rs:
                logits = stock(input_ids=torch.cat([p, r])[None], use_cache=False).logits[0]
                pred = logits[len(p) - 1: len(p) + len(r) - 1]
                lps.append(torch.log_softmax(pred, -1).gather(1, r[:, None])[:, 0])
                greedy.append(bool((pred.argmax(-1) == r).all()))
    return lps, greedy


def _check_lm(got, lps, greedy, atol):
    assert len(got.logprobs) == len(lps)
    for i, (a, b) in enumerate(zip(got.logprobs, lps)):
        torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=lambda m: f"response {i}: {m}")
    torch.testing.assert_close(got.sum_logprobs, torch.stack([x.sum() for x in lps]), atol=atol * 10, rtol=0)
    assert got.is_greedy.tolist() == greedy


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_and_greedy_equal_stock(arch, dtype, tiny_model, hf_oracle, groups, precision_for):
    ctx, atol, _ = precision_for(dtype)
    model = tiny_model(arch, dtype)
    stock = hf_oracle.stock_copy(model)
    prompts, responses = _lm_inputs(stock, groups)
    with ctx:
        lps, greedy = _lm_oracle(stock, prompts, responses)
        with torch.no_grad():
            one_row = flexgroup.score(model, prompts, responses)
            split = flexgroup.score(model, prompts, responses, max_tokens=16)   # several rows, a group split
    assert any(greedy) and not all(greedy)
    assert not flexgroup.patches.is_patched(model), "score must leave an unpatched model unpatched"
    assert one_row.rows == 1 and split.rows > 2
    assert one_row.grouped_tokens < one_row.baseline_tokens
    for got in (one_row, split):
        assert got.class_logits is None
        _check_lm(got, lps, greedy, atol)


def test_temperature_and_patched_model(tiny_model, hf_oracle, groups):
    model = tiny_model("llama", torch.float32)
    stock = hf_oracle.stock_copy(model)
    prompts, responses = groups([(7, [3, 5])], seed=1)
    _, ref = hf_oracle.run(stock, prompts, responses, temperature=0.7)
    flexgroup.patch(model, backend="sdpa")
    with torch.no_grad():
        got = flexgroup.score(model, prompts, responses, temperature=0.7)
    assert flexgroup.patches.is_patched(model), "an already patched model stays patched"
    for a, b in zip(got.logprobs, ref):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=0)


def test_sibling_leak_is_caught(tiny_model, hf_oracle, groups, causal_over_packed_row):
    """Broken attention (responses see their siblings): the checks above must fail."""
    model = tiny_model("llama", torch.float32)
    stock = hf_oracle.stock_copy(model)
    prompts, responses = _lm_inputs(stock, groups)
    lps, greedy = _lm_oracle(stock, prompts, responses)
    with torch.no_grad():
        got = flexgroup.score(model, prompts, responses)
    with pytest.raises(AssertionError):
        _check_lm(got, lps, greedy, 1e-5)


# ------------------------------------------------------------------ sequence classification
def _classifier(tiny_model, arch, dtype, num_labels=3):
    lm = tiny_model(arch, dtype)
    import transformers

    config = copy.deepcopy(lm.config)
    config.num_labels = num_labels
    torch.manual_seed(1)
    try:
        model = transformers.AutoModelForSequenceClassification.from_config(config).to(dtype)
    except ValueError as e:  # e.g. OLMo 2 has no classification head before transformers 5
        pytest.skip(f"transformers {transformers.__version__}: {str(e).splitlines()[0]}")
    model.model.load_state_dict(lm.model.state_dict())    # the tiny backbone with perturbed norms
    return model.eval()


def _cls_inputs(groups, pad):
    prompts, responses = groups(SIZES, seed=5)
    responses[0][0][-2:] = pad                 # ends with pads: pooled two tokens earlier
    responses[1][1][:] = pad                   # all pads: the stock model pools the prompt's last token
    responses[2][0][2] = pad                   # a pad inside a response does not matter
    return prompts, responses


def _cls_oracle(stock, prompts, responses):
    with torch.no_grad():
        return torch.stack([stock(input_ids=torch.cat([p, r])[None], use_cache=False).logits[0]
                            for p, rs in zip(prompts, responses) for r in rs])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("arch", ARCHS + ["olmo2"])   # olmo2: the self-checked generic path
def test_classification_logits_equal_stock(arch, dtype, tiny_model, hf_oracle, groups, precision_for):
    ctx, atol, _ = precision_for(dtype)
    model = _classifier(tiny_model, arch, dtype)
    stock = hf_oracle.stock_copy(model)
    prompts, responses = _cls_inputs(groups, model.config.pad_token_id)
    with ctx:
        ref = _cls_oracle(stock, prompts, responses)
        with torch.no_grad():
            got = flexgroup.score(model, prompts, responses)
            split = flexgroup.score(model, prompts, responses, max_tokens=12)
    assert got.logprobs is None and got.is_greedy is None
    assert ref.shape == got.class_logits.shape == (7, 3)
    for s in (got, split):
        torch.testing.assert_close(s.class_logits, ref, atol=atol * 10, rtol=0)
    assert split.rows > 2


def test_classification_without_pad_id_reads_last_token(tiny_model, hf_oracle, groups):
    model = _classifier(tiny_model, "llama", torch.float32)
    model.config.pad_token_id = None
    stock = hf_oracle.stock_copy(model)
    prompts, responses = _cls_inputs(groups, 0)
    with torch.no_grad():
        got = flexgroup.score(model, prompts, responses).class_logits
    torch.testing.assert_close(got, _cls_oracle(stock, prompts, responses), atol=1e-5, rtol=0)


def test_classification_pooling_ignoring_pads_is_caught(tiny_model, hf_oracle, groups, monkeypatch):
    """Broken pooling (always the last token, pads or not): the comparison must fail."""
    model = _classifier(tiny_model, "llama", torch.float32)
    stock = hf_oracle.stock_copy(model)
    prompts, responses = _cls_inputs(groups, model.config.pad_token_id)
    ref = _cls_oracle(stock, prompts, responses)
    monkeypatch.setattr(scoring, "_pooled_index", lambda seq, pad: seq.numel() - 1)
    with torch.no_grad():
        got = flexgroup.score(model, prompts, responses).class_logits
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_patch_finds_classifier_backbone(tiny_model, groups):
    model = _classifier(tiny_model, "qwen3", torch.float32)
    assert flexgroup.patch(model, backend="sdpa") is model and flexgroup.patches.is_patched(model)
    flexgroup.unpatch(model)
    assert not flexgroup.patches.is_patched(model)


def test_sorted_rows_and_errors():
    t = torch.tensor
    seqs = [t([1, 2, 3]), t([5]), t([1, 2, 4])]
    assert scoring.sorted_rows(seqs, 10) == [[0, 1, 2]]            # trie size 3 + 1 + 1
    assert scoring.sorted_rows(seqs, 4) == [[0, 2], [1]]           # neighbours in token order share a row
    assert scoring.sorted_rows([t([1] * 20), t([2])], 5) == [[0], [1]]   # too long: a row of its own
    assert scoring.sorted_rows(seqs, None) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="max_tokens"):
        scoring.sorted_rows(seqs, 0)
    with pytest.raises(ValueError, match="no responses"):
        flexgroup.score(torch.nn.Linear(1, 1), [t([1])], [[]])
    with pytest.raises(TypeError, match="neither"):
        flexgroup.score(torch.nn.Linear(1, 1), [t([1])], [[t([2])]])
