"""Score responses with shared-prefix forwards: log-probs, greedy flags, classification logits.

``flexgroup.score(model, prompts, responses)`` runs every ``[P; R_i]`` with each shared prefix
encoded once and returns, per response in input order:

- ``logprobs[i]`` [R_i] and ``sum_logprobs`` [N]: token log-probs ``log p(r_t | P, r_<t)``
  (``*ForCausalLM``);
- ``is_greedy`` [N]: whether every token of the response is the argmax of its predictive
  distribution (what evaluation harnesses report as ``is_greedy``);
- ``class_logits`` [N, num_labels]: for ``*ForSequenceClassification`` models (reward models,
  classifier judges), the head read where the stock model pools when it runs ``[P; R_i]`` alone:
  the last token that is not ``config.pad_token_id`` (the last token when no pad id is set).

A generative judge's verdict is a one-token response: its ``sum_logprobs`` is the verdict's log-prob.

Sequences are packed with :meth:`flexgroup.GroupedBatch.from_sequences` (a token-level prefix trie:
responses to one prompt share it, and prompts that start alike -- the same system prompt or few-shot
examples -- share their common prefix too) into rows of at most ``max_tokens`` tokens
(:func:`sorted_rows`). Unlike :func:`flexgroup.micro_batches`, a shared tree larger than the
budget is split over rows (its prefix is then encoded once per row), so a whole evaluation task that
shares one few-shot prefix still fits any budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..data.batch import GroupedBatch
from ..data.readout import read_plan, read_scores
from ..layout.checks import check_temperature, token_ids
from ..reference.model_checks import check_materialized, unwrap
from ..layout import Layout
from ..layout.trie import build_trie, sorted_lcp

__all__ = ["score", "Scores", "sorted_rows", "score_sequences"]

Tensor = torch.Tensor


@dataclass
class Scores:
    """Per-response results of :func:`score` (N responses, numbered group by group in input order).

    Attributes:
        logprobs: list of N tensors [R_i] (causal LMs; None for classifiers).
        sum_logprobs: [N] (causal LMs; None for classifiers).
        is_greedy: BoolTensor [N] (causal LMs; None for classifiers).
        class_logits: [N, num_labels] (``*ForSequenceClassification``; None for causal LMs).
        grouped_tokens: tokens through the model (all packed rows; causal LMs: the trie of the inputs).
        baseline_tokens: what one forward per response processes: ``sum_i len(P_i) + len(R_i)``, less
            one token per response for causal LMs (a sequence's last token is only predicted, never fed).
        rows: packed rows (forward calls).
    """

    logprobs: list[Tensor] | None
    sum_logprobs: Tensor | None
    is_greedy: Tensor | None
    class_logits: Tensor | None
    grouped_tokens: int
    baseline_tokens: int
    rows: int


def sorted_rows(sequences: Sequence[Tensor], max_tokens: int | None) -> list[list[int]]:
    """Split sequences into packed rows of at most ``max_tokens`` trie tokens.

    Sequences are taken in lexicographic token order, so sequences with a common prefix are
    neighbours; a row's packed length is the size of its prefix trie, ``sum_k len(s_k) - lcp(s_k,
    s_{k-1})`` in that order. A row is closed when the next sequence would overflow it; a sequence
    longer than the budget gets a row of its own.

    Args:
        sequences: 1-D LongTensors.
        max_tokens: token budget per row (None: one row).

    Returns:
        rows, each a list of sequence indices (in increasing order).
    """
    if max_tokens is not None and (isinstance(max_tokens, bool) or int(max_tokens) < 1):
        raise ValueError(f"max_tokens={max_tokens!r} must be a positive int (or None for one row)")
    if max_tokens is None:
        return [list(range(len(sequences)))]
    order, lcp = sorted_lcp(sequences)
    rows: list[list[int]] = []
    used = 0
    for k, c in zip(order, lcp):
        n = sequences[k].numel() - c  # tokens k adds to the trie of the sequences before it in token order
        if rows and used + n <= max_tokens:
            rows[-1].append(k)
            used += n
        else:
            rows.append([k])
            used = sequences[k].numel()
    return [sorted(r) for r in rows]


def _classifier_head(base: torch.nn.Module) -> torch.nn.Module | None:
    """The ``score`` head of a ``*ForSequenceClassification`` decoder, None for other models."""
    head = getattr(base, "score", None)
    return head if isinstance(head, torch.nn.Module) else None


def _pooled_index(seq: Tensor, pad_id: int | None) -> int:
    """Index the stock ``*ForSequenceClassification`` pools when it runs ``seq`` [S] alone:
    transformers' ``(arange(S) * (seq != pad_id)).argmax(-1)`` -- the last non-pad token, 0 when
    every token is a pad -- or the last token when the config has no pad id."""
    if pad_id is None:
        return seq.numel() - 1
    keep = torch.nonzero(seq != pad_id)
    return int(keep[-1]) if keep.numel() else 0


def _token_scores(logits: Tensor, index: Tensor, targets: Tensor, temperature: float,
                  dtype: torch.dtype | None = None, chunk: int = 4096) -> tuple[Tensor, Tensor]:
    """Log-probs [T] and greedy flags [T] of ``targets`` [T], each predicted by ``logits[index[t]]``.

    ``logits`` [K, V]; the log-softmax runs in ``dtype`` (default: the logits' dtype, float32 for
    half precision) in the shared readout (:mod:`flexgroup.data.readout`: each distinct row once),
    ``chunk`` rows at a time, so nothing larger than [chunk, V] is built.
    """
    plan = read_plan(index, targets)
    lp, _ = read_scores(logits, plan, temperature, chunk_size=chunk, dtype=dtype)
    work = lp.dtype
    top = torch.cat([logits.index_select(0, plan.rows[a:a + chunk]).to(work).div(temperature).argmax(-1)
                     for a in range(0, plan.rows.numel(), chunk)] + [index[:0]])      # [R] each row's argmax
    return lp, top[plan.pair_row[plan.reader]] == targets


def _causal_row(model: torch.nn.Module, seqs: list[Tensor], starts: list[int], device: torch.device,
                temperature: float, dtype: torch.dtype | None) -> tuple[list[Tensor], list[bool], int]:
    """Score ``seqs[i][starts[i]:]`` in one packed row: (log-probs per sequence, greedy flags, row tokens).

    The row holds each sequence's *inputs* ``seq[:-1]`` (the last token is only a target), as the stock
    model scores a sequence: a sequence of ``max_position_embeddings + 1`` tokens fits, and only the
    logit rows that predict a scored token go through the LM head.
    """
    inputs = [s[:-1] for s in seqs]                        # >= 1 token each (1 <= start < len)
    trie = build_trie([x.tolist() for x in inputs])
    # the trusted constructor: nothing is read through the batch's own loss masks (all False)
    batch = GroupedBatch(Layout.tree(trie.parents, trie.lengths), trie.packed_row(inputs), list(trie.paths),
                         [torch.zeros(x.numel(), dtype=torch.bool) for x in inputs])
    pred = torch.cat([p[b - 1:] for p, b in zip(batch.paths, starts)])               # [T] packed rows
    keep = torch.unique(pred)                                                         # [K] sorted
    out = model(**batch.model_inputs(device), logits_to_keep=keep.to(device))
    lp, hit = _token_scores(out.logits[0], torch.searchsorted(keep, pred).to(device),
                            torch.cat([s[b:] for s, b in zip(seqs, starts)]).to(device), temperature, dtype)
    sizes = [s.numel() - b for s, b in zip(seqs, starts)]
    return list(lp.split(sizes)), [bool(h.all()) for h in hit.split(sizes)], batch.num_tokens


def score_sequences(model: torch.nn.Module, sequences: list[Tensor], starts: list[int], *,
                    max_tokens: int | None, temperature: float, backend: str,
                    softmax_dtype: torch.dtype | None = None) -> Scores:
    """Score ``sequences[i][starts[i]:]`` given ``sequences[i][:starts[i]]`` (``1 <= starts[i] < len``).

    Causal LMs: ``max_tokens`` bounds the packed inputs (each sequence but its last token);
    ``softmax_dtype`` is the log-softmax's dtype (default: the logits', float32 for half precision).
    """
    from ..patches import is_patched, patch, unpatch

    temperature = check_temperature("score", temperature)
    check_materialized(model, "score")
    base = unwrap(model)
    head = _classifier_head(base)
    get_head = getattr(base, "get_output_embeddings", None)
    if head is None and (not callable(get_head) or get_head() is None):
        raise TypeError(f"score: model is a {type(base).__name__}, neither a *ForCausalLM nor a "
                        "*ForSequenceClassification model (no LM head, no .score head): pass the model with its "
                        "head (e.g. `model`, not the bare decoder `model.model`)")
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    device = next(model.parameters()).device
    n = len(sequences)
    lps: list[Tensor | None] = [None] * n
    greedy = torch.zeros(n, dtype=torch.bool)
    cls_out: list[Tensor | None] = [None] * n
    masks = [torch.arange(s.numel()) >= b for s, b in zip(sequences, starts)]
    rows = sorted_rows(sequences if head is not None else [s[:-1] for s in sequences], max_tokens)
    grouped = 0
    patched_here = not is_patched(model)
    if patched_here:
        patch(model, backend=backend)
    try:
        for row in rows:
            if head is None:
                lp, hit, n_row = _causal_row(model, [sequences[k] for k in row], [starts[k] for k in row], device,
                                             temperature, softmax_dtype)
                grouped += n_row
                for i, k in enumerate(row):
                    lps[k], greedy[k] = lp[i], hit[i]
                continue
            batch = GroupedBatch.from_sequences([sequences[k] for k in row], [masks[k] for k in row])
            grouped += batch.num_tokens
            hidden = base.base_model(**batch.model_inputs(device)).last_hidden_state[0]     # [L, H]
            at = [int(p[_pooled_index(batch.input_ids[p], config.pad_token_id)]) for p in batch.paths]
            logits = head(hidden.index_select(0, torch.tensor(at, device=hidden.device)))  # [n_row, labels]
            for i, k in enumerate(row):
                cls_out[k] = logits[i]
    finally:
        if patched_here:
            unpatch(model)
    baseline = sum(s.numel() for s in sequences) - (0 if head is not None else n)   # causal: inputs only
    if head is not None:
        return Scores(None, None, None, torch.stack(cls_out), grouped, baseline, len(rows))
    return Scores(lps, torch.stack([x.sum() for x in lps]), greedy, None, grouped, baseline, len(rows))


def score(model: torch.nn.Module, prompts: Sequence[Tensor], responses: Sequence[Sequence[Tensor]], *,
          max_tokens: int | None = None, temperature: float = 1.0, backend: str = "auto") -> Scores:
    """Score every ``[prompts[g]; responses[g][j]]``, each shared prefix encoded once per packed row.

    Runs under the caller's grad mode: call it under ``torch.no_grad()`` for inference (the usual
    case); with gradients enabled the results are differentiable. A model that is not patched is
    patched for the call (:func:`flexgroup.patch` with ``backend``) and unpatched afterwards; an
    already patched model keeps its own backend.

    Args:
        model: a Hugging Face ``*ForCausalLM`` or ``*ForSequenceClassification`` decoder (optionally
            PEFT-wrapped).
        prompts: G non-empty 1-D LongTensors [P_g].
        responses: per prompt, a non-empty list of non-empty 1-D LongTensors [R_gj].
        max_tokens: token budget of one packed row (None: one row for everything).
        temperature: causal LMs: logits are divided by it before the log-softmax.
        backend: ``"auto"`` (flex on CUDA, the exact lse backend on CPU), ``"lse"``, ``"sdpa"``, ``"flex"``.

    Returns:
        :class:`Scores` over N = total responses, numbered group by group.
    """
    prompts = [token_ids(p, f"prompt {g}") for g, p in enumerate(prompts)]
    responses = [[token_ids(r, f"response {j} of prompt {g}") for j, r in enumerate(rs)] for g, rs in enumerate(responses)]
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"score: {len(prompts)} prompts and {len(responses)} response lists: give one "
                         "(non-empty) list of responses per prompt")
    for g, rs in enumerate(responses):
        if not rs:
            raise ValueError(f"score: prompt {g} has no responses")
    seqs = [torch.cat([p, r]) for p, rs in zip(prompts, responses) for r in rs]
    starts = [p.numel() for p, rs in zip(prompts, responses) for _ in rs]
    return score_sequences(model, seqs, starts, max_tokens=max_tokens, temperature=temperature, backend=backend)
