"""Tiny random checkpoints on disk, with a tokenizer, for the examples and offline smoke runs.

Nothing is downloaded: the tokenizer is a word-level one over the letters ``a``..``z`` (whitespace
separated; ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, letters 3..28) with a plain chat template, and the
weights are random. The test suite keeps its own builder (``tests/_trainers.py``) on purpose: tests
do not depend on the code they check.
"""

from __future__ import annotations

import tempfile

import torch

LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
# each message's words, then "a" as the assistant's turn marker when a generation prompt is asked for
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}a {% endif %}"


def word_tokenizer():
    """``PreTrainedTokenizerFast`` over :data:`LETTERS` with :data:`CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(LETTERS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_checkpoint(path: str | None = None, *, num_labels: int | None = None, hidden: int = 64,
                         layers: int = 2, max_positions: int = 512, seed: int = 0) -> str:
    """Save a random Llama (GQA: 4 query / 2 KV heads) and :func:`word_tokenizer` to ``path``.

    Args:
        path: target directory (default: a new temporary directory).
        num_labels: None for a ``LlamaForCausalLM``; an int for a ``LlamaForSequenceClassification``
            with that many labels (a reward model: 1), which pools the last non-pad token.
        hidden, layers, max_positions, seed: model size, depth, position limit, weight seed.

    Returns:
        the directory, loadable offline with ``from_pretrained(path, local_files_only=True)``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = word_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, pad_token_id=0, eos_token_id=1,
                         bos_token_id=None, num_labels=num_labels or 2)
    path = path or tempfile.mkdtemp(prefix="flexgroup_tiny_")
    torch.manual_seed(seed)
    cls = LlamaForCausalLM if num_labels is None else LlamaForSequenceClassification
    cls(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
