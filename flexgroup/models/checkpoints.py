"""Tiny random checkpoints on disk, with a tokenizer, for the examples and offline smoke runs.

Nothing is downloaded: the tokenizer is a word-level one over the letters ``a``..``z`` (whitespace
separated; ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, letters 3..28) with a plain chat template, and the
weights are random. The test suite keeps its own builder (``tests/_trainers.py``) on purpose: tests
do not depend on the code they check.

Without a ``path`` a checkpoint is saved once into a cache folder (:func:`cache_dir`) and reused by
every later call with the same arguments, so examples run again and again leave nothing behind.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import torch

_COMPLETE = "flexgroup-complete"  # written last: a folder without it was never finished (never returned)

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
                                        unk_token="<unk>", model_input_names=["input_ids", "attention_mask"])
    # no token_type_ids: TRL 0.20's generation passes them on, and a Llama refuses them
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def cache_dir() -> pathlib.Path:
    """Where :func:`save_tiny_checkpoint` keeps its checkpoints: ``$FLEXGROUP_CACHE``, else
    ``$XDG_CACHE_HOME/flexgroup``, else ``~/.cache/flexgroup`` (each under ``tiny-checkpoints/``)."""
    root = os.environ.get("FLEXGROUP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "flexgroup")
    return pathlib.Path(root) / "tiny-checkpoints"


def save_tiny_checkpoint(path: str | None = None, *, num_labels: int | None = None, hidden: int = 64,
                         layers: int = 2, max_positions: int = 512, seed: int = 0) -> str:
    """Save a random Llama (GQA: 4 query / 2 KV heads) and :func:`word_tokenizer` to ``path``.

    Args:
        path: target directory (default: a folder of :func:`cache_dir` named after the arguments and the
            torch / transformers versions, written once -- atomically, so parallel calls are safe -- and
            reused by later calls with the same arguments).
        num_labels: None for a ``LlamaForCausalLM``; an int for a ``LlamaForSequenceClassification``
            with that many labels (a reward model: 1), which pools the last non-pad token.
        hidden, layers, max_positions, seed: model size, depth, position limit, weight seed.

    Returns:
        the directory, loadable offline with ``from_pretrained(path, local_files_only=True)``. The caller's
        random number generator state is left as it was.
    """
    import transformers

    args = dict(num_labels=num_labels, hidden=hidden, layers=layers, max_positions=max_positions, seed=seed)
    if path is not None:
        _save(str(path), **args)
        return str(path)
    head = "causal-lm" if num_labels is None else f"classifier-{num_labels}"
    name = (f"llama-{head}-h{hidden}-l{layers}-p{max_positions}-seed{seed}-tok2-torch{torch.__version__}"
            f"-transformers{transformers.__version__}").replace("+", "_")
    final = cache_dir() / name
    if (final / _COMPLETE).is_file():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.", dir=final.parent)
    try:
        _save(tmp, **args)
        pathlib.Path(tmp, _COMPLETE).write_text("")
        try:
            os.rename(tmp, final)
        except OSError:  # another process renamed its identical copy first (same arguments, same seed)
            if not (final / _COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left once renamed
    return str(final)


def _save(path: str, *, num_labels: int | None, hidden: int, layers: int, max_positions: int, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = word_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, pad_token_id=0, eos_token_id=1,
                         bos_token_id=None, num_labels=num_labels or 2)
    cls = LlamaForCausalLM if num_labels is None else LlamaForSequenceClassification
    with torch.random.fork_rng(devices=[]):  # the weights follow `seed`; the caller's generator is untouched
        torch.manual_seed(seed)
        model = cls(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
