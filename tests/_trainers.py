"""Helpers for trainer and harness tests (TRL, lm-evaluation-harness), which load models by path:
a tiny word-level tokenizer, a tiny random Llama checkpoint on disk, a trainer mixin that records one
step, and an independent token counter. Nothing is downloaded.

Tokens: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then the letters ``a``..``z`` (3..28), split on spaces.
"""

from __future__ import annotations

import torch

LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]


def word_tokenizer():
    """PreTrainedTokenizerFast over ``LETTERS`` (whitespace-separated words), pad 0, eos 1, unk 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(LETTERS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def save_tiny_llama(path, max_positions: int = 128, seed: int = 0) -> str:
    """Save a random 2-layer Llama (hidden 32, GQA 4/2 heads) and :func:`word_tokenizer` to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = word_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


class Recording:
    """Trainer mixin (put it first in the bases): keeps the last loss, the last value of every train
    metric and a copy of every parameter gradient of the (single) training step."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.recorded_loss = loss.detach().clone()
        self.recorded_metrics = {k: v[-1] for k, v in self._metrics["train"].items() if v}
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        out = super().training_step(model, inputs, num_items_in_batch)
        self.recorded_grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()
                               if p.grad is not None}
        return out


def count_tokens(trainer) -> list[int]:
    """Independent count: a one-element list that accumulates the tokens entering the policy's and the
    reference model's embedding layers."""
    counts = [0]

    def hook(mod, args):
        counts[0] += args[0].numel()

    for m in (trainer.model, trainer.ref_model):
        m.get_input_embeddings().register_forward_pre_hook(hook)
    return counts
