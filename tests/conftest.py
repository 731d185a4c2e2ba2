"""Shared fixtures: tiny random Hugging Face decoders and the repeated-prefix baseline.

Helpers are exposed as fixtures so that test files never import this module:

- ``tiny_model(arch, dtype=float32, window=4, seed=0, **config_overrides)``: a tiny random
  ``*ForCausalLM`` (``TINY_ARCHS``) with its stock attention, in eval mode;
- ``hf_oracle``: the repeated-prefix baseline (``stock_copy``, ``run``, ``loss``, ``grads``,
  ``assert_grads_close``);
- ``groups(sizes, seed=0)``: random ``(prompts, responses)`` for ``[(prompt_len, [resp_lens]), ...]``;
- ``precision_for(dtype)``: ``(context, logprob atol, grad rel)``; float64 keeps HF norms in float64.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from contextlib import nullcontext

import pytest
import torch
from torch.overrides import TorchFunctionMode

from flexgroup.reference.oracle import logits_alone

# Tests mirror the packages of flexgroup/ (tests/layout, data, kernels, patches, stream, verification, train,
# integrations, bench, cli, docs, package, reference, real; basenames unique
# in the whole suite). The shared helpers stay here at the root and are imported by module name
# (``from _core_reference import ...``), and a few tests reuse another's builders (``from test_vl
# import make_vl``): put the root and every layer folder on sys.path, whatever pytest's import mode.
_TESTS = Path(__file__).resolve().parent
for _d in [_TESTS, *sorted(p for p in _TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))]:
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

# tiny models gain nothing from threads, and on a shared 2-core machine spinning OpenMP threads cost a lot
torch.set_num_threads(1)

VOCAB = 61

# Common tiny shape: hidden 32, 2 layers, 4 query heads / 2 KV heads (GQA), head_dim 8.
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=0)

# name -> (config class, model class, config overrides); "W" is replaced by the ``window`` argument
TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": "W", "head_dim": 8}),
    # use_sliding_window with max_window_layers=1: layer 0 full, layer 1 sliding
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": "W",
                                                 "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention"],
                                                 "sliding_window": "W", "head_dim": 8}),
    # small softcap so that it bites; query_pre_attn_scalar != head_dim so its scaling matters
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": "W", "head_dim": 8,
                                                    "attn_logit_softcapping": 2.0, "final_logit_softcapping": 30.0,
                                                    "query_pre_attn_scalar": 12}),
    # generic path (outside the registry)
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"attention_multiplier": 0.3, "embedding_multiplier": 2.0,
                                                       "residual_multiplier": 0.7, "logits_scaling": 1.5}),
}
REGISTRY_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2"]
GENERIC_ARCHS = ["olmo2", "granite"]
WINDOWED_ARCHS = ["mistral", "qwen2", "qwen3", "gemma2"]
# stock sdpa ignores Gemma 2's softcapping: its baseline runs eager
STOCK_ATTN = {"gemma2": "eager"}


def make_tiny(arch: str, dtype: torch.dtype = torch.float32, window: int = 4, seed: int = 0, **overrides):
    """A tiny random ``*ForCausalLM`` of ``arch`` in ``dtype`` with its stock attention, eval mode."""
    import transformers

    cfg_name, model_name, extra = TINY_ARCHS[arch]
    kw = {**_COMMON, **{k: (window if v == "W" else v) for k, v in extra.items()}, **overrides}
    kw.setdefault("attn_implementation", STOCK_ATTN.get(arch, "sdpa"))
    config = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype)
    with torch.no_grad():  # non-trivial norm weights (Gemma's init is zero-centred)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm)


class KeepFloat64(TorchFunctionMode):
    """Float64 tests: HF RMSNorms upcast to float32 internally, which would cap agreement near 1e-7.

    Inside this mode a float64 tensor asked to become float32 stays float64. Applied identically to
    the grouped run and to the baseline, so it changes precision only, not what is compared.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
            if func is torch.Tensor.float:
                return x
            if func is torch.Tensor.to:
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:  # e.g. eager attention's softmax(..., dtype=float32)
                kwargs["dtype"] = torch.float64
        if func in _MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args):
            # older RoPE code multiplies float64 inv_freq by position_ids.float() (float32)
            args = tuple(a.double() if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a
                         for a in args)
        return func(*args, **kwargs)


class Oracle:
    """The repeated-prefix baseline: each ``[P; R_i]`` alone through a stock, unpatched model."""

    @staticmethod
    def stock_copy(model):
        # deepcopy copies the config too (two models built from one config share _attn_implementation)
        return copy.deepcopy(model)

    @staticmethod
    def run(stock, prompts, responses, temperature: float = 1.0):
        """Returns (logits, logprobs): per response, logits [P+R, V] and log-probs [R]."""
        logits, lps = [], []
        for p, rs in zip(prompts, responses):
            for r in rs:
                out = logits_alone(stock, torch.cat([p, r]))
                logits.append(out)
                pred = out[len(p) - 1: len(p) + len(r) - 1] / temperature  # logit rows that predict r
                lps.append(torch.log_softmax(pred, -1).gather(1, r[:, None])[:, 0])
        return logits, lps

    @staticmethod
    def loss(lps, advantages):
        """GRPO-style loss: advantage-weighted sum of response log-probs."""
        return sum(a * lp.sum() for a, lp in zip(advantages, lps))

    @staticmethod
    def grads(model) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    @staticmethod
    def assert_grads_close(got: dict, ref: dict, rel: float):
        assert got.keys() == ref.keys(), f"gradient sets differ: {sorted(got.keys() ^ ref.keys())}"
        for n in ref:
            scale = ref[n].abs().max().item()
            err = (got[n] - ref[n]).abs().max().item()
            assert err <= rel * max(scale, 1e-30), f"{n}: grad error {err:.3g} vs scale {scale:.3g}"


def random_groups(sizes, seed=0, vocab=VOCAB):
    """``sizes``: list of (prompt_len, [response_lens]) -> (prompts, responses) of random ids."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (p,), generator=g) for p, _ in sizes]
    responses = [[torch.randint(1, vocab, (n,), generator=g) for n in rs] for _, rs in sizes]
    return prompts, responses


@pytest.fixture
def tiny_model():
    return make_tiny


@pytest.fixture
def hf_oracle():
    return Oracle


@pytest.fixture
def groups():
    return random_groups


def precision(dtype):
    """(context, logprob atol, grad rel) per dtype: float64 with norms kept in float64, float32 per issue 3."""
    if dtype == torch.float64:
        return KeepFloat64(), 1e-10, 1e-8
    return nullcontext(), 1e-5, 1e-4


@pytest.fixture
def precision_for():
    return precision


@pytest.fixture
def causal_over_packed_row(monkeypatch):
    """The classic silent bug in place of flexgroup's attention: plain causal attention over the
    packed row (responses see their siblings). Checks that verify/demo really detect it."""
    import torch.nn.functional as F

    from flexgroup.kernels.lse import LseBackend
    from flexgroup.kernels.sdpa import SdpaBackend

    def wrong(self, plan, q, k, v, scale):
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              is_causal=True, scale=scale)

    monkeypatch.setattr(SdpaBackend, "run", wrong)
    monkeypatch.setattr(LseBackend, "run", wrong)   # the CPU default

