"""lm-eval model ``flexgroup`` truncates as lm-evaluation-harness's ``HFLM`` does.

HFLM feeds the model the last ``max_length`` tokens of ``context + continuation`` without its final
token; ``loglikelihood_rolling`` cuts a document into windows of ``max_length`` predicted tokens. The
oracle is stock ``HFLM`` on the same tiny checkpoint, whose ``max_length`` is the model's
``max_position_embeddings`` (32): every full rolling window and every request over 32 tokens reaches
the model's last position.
"""

from __future__ import annotations

import pytest
import torch

from _trainers import LETTERS, save_tiny_llama

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'flexgroup[eval]')")

MAX_POS = 32
TOL = {"float64": 1e-12, "float32": 2e-5}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_trunc"), max_positions=MAX_POS, seed=3)


def _words(g, n):
    return " ".join(LETTERS[int(i)] for i in torch.randint(0, 26, (n,), generator=g))


def _requests():
    from lm_eval.api.instance import Instance

    g = torch.Generator().manual_seed(7)
    shots = _words(g, 45)                                    # longer than max_length on its own
    pairs = [(shots + " " + _words(g, 4), " " + _words(g, c)) for c in (1, 3)]
    pairs += [(_words(g, 6), " " + _words(g, 2)),            # short: no truncation
              (_words(g, 1), " " + _words(g, MAX_POS)),      # continuation of exactly max_length tokens
              (_words(g, 1), " " + _words(g, 1))]            # 1 context + 1 continuation token
    ll = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    docs = [_words(g, 80), _words(g, MAX_POS), _words(g, 5)]  # 3 windows; exactly one window; a short one
    rolling = [Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)]
    return ll, rolling


def _models(checkpoint, dtype, monkeypatch):
    from lm_eval.models.huggingface import HFLM

    import flexgroup.integrations.lm_eval as fg_eval

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    common = dict(pretrained=checkpoint, device="cpu", dtype=dtype, batch_size=4)
    return fg_eval.FlexGroupLM(max_tokens=48, **common), HFLM(**common)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_truncated_requests_and_rolling_windows_equal_stock_hflm(checkpoint, dtype, monkeypatch):
    ours, stock = _models(checkpoint, dtype, monkeypatch)
    assert ours.max_length == stock.max_length == MAX_POS
    ll, rolling = _requests()
    got, ref = ours.loglikelihood(ll), stock.loglikelihood(ll)
    assert [g for _, g in got] == [r for _, r in ref]
    assert max(abs(a - b) for (a, _), (b, _) in zip(got, ref)) <= TOL[dtype]
    got_r, ref_r = ours.loglikelihood_rolling(rolling), stock.loglikelihood_rolling(rolling)
    assert max(abs(a - b) for a, b in zip(got_r, ref_r)) <= TOL[dtype] * 10


def test_a_truncation_off_by_one_token_is_caught(checkpoint, monkeypatch):
    """Broken variant: each sequence loses its first (oldest) context token as well."""
    import flexgroup.integrations.lm_eval as fg_eval

    ours, stock = _models(checkpoint, "float64", monkeypatch)
    real = fg_eval.score_sequences
    monkeypatch.setattr(fg_eval, "score_sequences",
                        lambda model, seqs, starts, **kw: real(model, [s[1:] for s in seqs], [b - 1 for b in starts], **kw))
    ll, _ = _requests()
    got, ref = ours.loglikelihood(ll[:2]), stock.loglikelihood(ll[:2])
    assert max(abs(a - b) for (a, _), (b, _) in zip(got, ref)) > 1e-6


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice made without CUDA")
def test_device_defaults_to_cpu_without_cuda(checkpoint, monkeypatch):
    import flexgroup.integrations.lm_eval as fg_eval

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert fg_eval.FlexGroupLM(pretrained=checkpoint, dtype="float32").device == torch.device("cpu")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match=r"device='cuda' but this PyTorch build is CPU-only.*pass device='cpu'"):
        fg_eval.FlexGroupLM(pretrained=checkpoint, device="cuda")


@pytest.mark.parametrize("build_cuda", [None, "12.8"])
def test_cuda_refusal_tells_a_cpu_only_build_from_a_cuda_build_without_gpu(monkeypatch, build_cuda):
    """A CPU-only build needs another torch; a CUDA build that sees no GPU needs a driver or a visible device."""
    import flexgroup.integrations.lm_eval as fg_eval

    monkeypatch.setattr(torch.version, "cuda", build_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError) as info:
        fg_eval.FlexGroupLM(pretrained="unused", device="cuda:0")   # refused before anything is loaded
    text = str(info.value)
    assert "device='cuda:0'" in text and "device='cpu'" in text
    if build_cuda is None:
        assert "CPU-only" in text and "install a CUDA build" in text and "sees no GPU" not in text
    else:
        assert "supports CUDA 12.8" in text and "sees no GPU" in text and "nvidia-smi" in text
        assert "CPU-only" not in text and "install a CUDA build" not in text
