"""Log-likelihood / multiple-choice evaluation with shared contexts encoded once.

Evaluation harnesses score ``(context, continuation)`` requests: a multiple-choice question is one
context (often a long few-shot prompt) with 4-10 continuations, and the harness runs
``[context; continuation]`` once per choice. Here every request becomes the sequence
``context + continuation`` and requests are packed with a token-level prefix trie
(:func:`flexgroup.train.scoring.sorted_rows` + :meth:`flexgroup.GroupedBatch.from_sequences`): the choices of
one question share their context, and questions share the few-shot examples their contexts start
with, each encoded once per packed row of at most ``max_tokens`` tokens.

Results equal running each request alone through the stock model (the tests compare with exactly
that and with lm-evaluation-harness's own ``HFLM``): ``(log-likelihood, is_greedy)`` per request, in
input order, where ``is_greedy`` says every continuation token is the argmax of its predictive
distribution. For the harness itself see :mod:`flexgroup.integrations.lm_eval`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..layout.checks import token_ids
from .scoring import score_sequences

__all__ = ["loglikelihood", "multiple_choice", "encode_pair"]

Tensor = torch.Tensor


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of ``(context, continuation)`` the way lm-evaluation-harness builds them.

    Trailing whitespace of the context moves to the continuation; the continuation's ids are those of
    ``tokenizer(context + continuation)`` after the context's ids (no special tokens added).
    """
    if not context:
        raise ValueError("encode_pair: the context is empty: give at least one token of context (harnesses "
                         "use the BOS/EOS token as the context of an unconditional request)")
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def _as_ids(context, continuation, tokenizer, k: int) -> tuple[Tensor, Tensor]:
    if isinstance(context, str) or isinstance(continuation, str):
        if tokenizer is None:
            raise ValueError(f"request {k} holds strings: pass tokenizer= (or give token ids)")
        context, continuation = encode_pair(tokenizer, str(context), str(continuation))
    return token_ids(context, f"context of request {k}"), token_ids(continuation, f"continuation of request {k}")


def loglikelihood(model: torch.nn.Module, requests: Sequence[tuple[Any, Any]], *, tokenizer: Any = None,
                  max_tokens: int | None = 8192, backend: str = "auto") -> list[tuple[float, bool]]:
    """``(log p(continuation | context), is_greedy)`` for each ``(context, continuation)`` request.

    Args:
        model: a Hugging Face ``*ForCausalLM`` (patched or not; see :func:`flexgroup.score`).
        requests: ``(context, continuation)`` pairs of 1-D token ids (tensors or lists), or of
            strings together with ``tokenizer`` (split as :func:`encode_pair` does). Contexts and
            continuations must be non-empty.
        tokenizer: a Hugging Face tokenizer, needed for string requests.
        max_tokens: token budget of one packed row (None: everything in one row).
        backend: attention backend when the model gets patched for the call.

    Returns:
        one ``(log-likelihood, is_greedy)`` per request, in input order. Runs under ``torch.no_grad()``.
    """
    pairs = [_as_ids(c, x, tokenizer, k) for k, (c, x) in enumerate(requests)]
    if not pairs:
        return []
    seqs = [torch.cat([c, x]) for c, x in pairs]
    with torch.no_grad():
        res = score_sequences(model, seqs, [c.numel() for c, _ in pairs], max_tokens=max_tokens,
                               temperature=1.0, backend=backend)
    return [(float(s), bool(g)) for s, g in zip(res.sum_logprobs.tolist(), res.is_greedy.tolist())]


def multiple_choice(model: torch.nn.Module, questions: Sequence[tuple[Any, Sequence[Any]]], **kwargs
                    ) -> list[list[tuple[float, bool]]]:
    """Score every choice of every question: ``questions[q] = (context, [continuation, ...])``.

    Keyword arguments as in :func:`loglikelihood`. Returns, per question, one
    ``(log-likelihood, is_greedy)`` per choice, in input order; the predicted answer of question
    ``q`` is ``argmax_j result[q][j][0]``.
    """
    flat = [(ctx, cont) for ctx, conts in questions for cont in conts]
    res = loglikelihood(model, flat, **kwargs)
    out, k = [], 0
    for _, conts in questions:
        out.append(res[k:k + len(conts)])
        k += len(conts)
    return out
