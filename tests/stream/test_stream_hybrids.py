"""stream_backward on hybrids: recurrent and conv states kept at chunk boundaries (issue 21).

Oracle: every sequence alone through a deep copy of the unpatched model. float64 runs under
``KeepFloat64`` (the GDN / Mamba2 scans stay in float64): log-probs and every parameter gradient.
float32: the Gated DeltaNet scan is noisy in float32 (FIELD-NOTES: stock float32 vs a float64 truth
differ by percents on some gradients), so its log-prob tolerance is 1e-4 there.
"""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup.models.zoo import build_model, unavailable
from flexgroup.reference.oracle import logprobs_alone
from flexgroup.stream import hybrid_fork

pytestmark = pytest.mark.skipif(bool(unavailable("qwen3_5_text")), reason=str(unavailable("qwen3_5_text")))


def _sequences(vocab: int) -> list[torch.Tensor]:
    """A 300-token prompt (cut by a 128 budget), responses, a branch 2 tokens into a response (a segment
    shorter than the conv window), a strict prefix and a duplicate."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, vocab, (300,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(1, vocab, (n,), generator=g)]) for n in (70, 90, 2, 150)]
    seqs.append(torch.cat([seqs[3][:302], torch.randint(1, vocab, (40,), generator=g)]))
    return seqs + [seqs[0][:320].clone(), seqs[1].clone()]


def _build(arch, dtype):
    if why := unavailable(arch):  # below the transformers flexgroup declares for it (a refusal above it fails)
        pytest.skip(why)
    return build_model(arch, dtype=dtype)


def _run(arch, dtype, budget, hf_oracle, precision_for):
    """stream_backward vs each sequence alone: AssertionError naming the log-prob or gradient error."""
    ctx, atol, rel = precision_for(dtype)
    if dtype == torch.float32 and arch == "qwen3_5_text":
        atol = 1e-4
    model = _build(arch, dtype)
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model)
    seqs = _sequences(model.config.vocab_size)
    adv = torch.linspace(-1.0, 1.5, len(seqs), dtype=dtype)
    with ctx:
        res = flexgroup.stream_backward(model, seqs, lambda lp, i: -(lp * adv[i, None].to(lp.dtype)).sum(),
                                        budget=budget)
        err = 0.0
        for i, s in enumerate(seqs):
            lp = logprobs_alone(stock, s)
            err = max(err, (lp - res.logprobs[i, 1: s.numel()].to(lp.dtype)).abs().max().item())
            (-(lp * adv[i]).sum()).backward()
    assert res.forwards > 2
    assert err <= atol, f"log-prob error {err:.3g}"
    hf_oracle.assert_grads_close(hf_oracle.grads(model), hf_oracle.grads(stock), rel)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("arch", ["qwen3_5_text", "bamba"])
def test_hybrid_tree_streamed_equals_each_sequence_alone(arch, dtype, hf_oracle, precision_for):
    _run(arch, dtype, 128, hf_oracle, precision_for)


def test_gated_deltanet_cut_after_a_two_token_segment_continues_its_conv_window(hf_oracle, precision_for):
    # budget 301: the chunk ends one token into the branch, so the next chunk's root piece continues a path
    # whose last conv inputs straddle the cut
    _run("qwen3_5_text", torch.float64, 301, hf_oracle, precision_for)


def test_recurrent_state_not_carried_across_chunks_is_caught(hf_oracle, precision_for, monkeypatch):
    # broken variant: depth-0 segments of a chunk start from zeros instead of their parent's kept state
    def from_zeros(self, level):
        self.level = level
        return hybrid_fork.ForkStates.initial(self, level)

    monkeypatch.setattr(hybrid_fork._StreamStates, "initial", from_zeros)
    with pytest.raises(AssertionError, match="log-prob error"):
        _run("bamba", torch.float64, 128, hf_oracle, precision_for)


def test_conv_window_not_continued_across_chunks_is_caught(hf_oracle, precision_for, monkeypatch):
    # broken variant: the conv context of a chunk's cut roots is zeros instead of the kept last inputs
    real = hybrid_fork._extend

    def no_context(base, layout, stream, k, device):
        cp = real(base, layout, stream, k, device)
        return hybrid_fork._ConvPlan(base, cp.external, cp.keep_index)

    monkeypatch.setattr(hybrid_fork, "_extend", no_context)
    with pytest.raises(AssertionError, match="log-prob error"):
        _run("bamba", torch.float64, 128, hf_oracle, precision_for)


def test_hybrid_stream_logprobs_equal_the_stock_model_without_gradients(hf_oracle, precision_for):
    ctx, atol, _ = precision_for(torch.float64)
    model = _build("bamba", torch.float64)
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model)
    seqs = _sequences(model.config.vocab_size)
    with ctx:
        lp = flexgroup.stream_logprobs(model, seqs, budget=128)
        err = max((logprobs_alone(stock, s) - lp[i, 1: s.numel()]).abs().max().item() for i, s in enumerate(seqs))
    assert err <= atol and not lp.requires_grad
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("arch", ["qwen3_5_text", "bamba"])
def test_hybrid_streams_exactly_under_gradient_checkpointing(arch, hf_oracle, precision_for):
    # recomputation reruns the mixers of a chunk: they must attend to the same kept states, not record again
    _, atol, rel = precision_for(torch.float32)
    model = _build(arch, torch.float32).train()
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seqs = _sequences(model.config.vocab_size)
    res = flexgroup.stream_backward(model, seqs, lambda lp, i: lp.sum(), budget=128)
    err = 0.0
    for i, s in enumerate(seqs):
        lp = logprobs_alone(stock, s)
        err = max(err, (lp - res.logprobs[i, 1: s.numel()]).abs().max().item())
        lp.sum().backward()
    assert err <= (1e-4 if arch == "qwen3_5_text" else atol)
    hf_oracle.assert_grads_close(hf_oracle.grads(model), hf_oracle.grads(stock), rel)
