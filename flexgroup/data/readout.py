"""Per-token log-probs and entropies read out of logit rows (data): the one readout of every caller.

``GroupedBatch.logprobs``, scoring, streaming and the trainer adapters all ask the same question: for T
reads ``(logit row, target)``, the log-prob of the target under the row's softmax (and the row's entropy).
In a tree a shared turn's token is read once per sequence that contains it, and a branch point's row
is read for several targets. The readout therefore works on what is distinct (invariant 10):

- :func:`read_plan` folds the T reads into R distinct rows and P distinct (row, target) pairs;
- :func:`read_scores` computes each row's log-sum-exp (and entropy) once and each pair's log-prob once,
  then copies the pair's value to its k readers. Autograd sums the k readers' gradients into the pair
  before anything else, which is the k-fold weight the repeated baseline applies by reading k copies.

Memory: :class:`_RowScores` saves the logits (the caller's tensor, no copy), ``lse [R]`` (and ``ent [R]``)
and the index tensors for backward; it recomputes ``softmax = exp(x / tau - lse)`` chunk by chunk in
backward. Nothing of size ``[rows, V]`` besides the logits and their gradient outlives a chunk.

No transformers import here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["ReadPlan", "read_plan", "read_scores", "rows_fit"]

Tensor = torch.Tensor

# Rows the LM head runs on at least: a CPU float32 matmul of 1-3 rows (at 2 threads also 5-7 and 9-11)
# takes another kernel than one of more rows, so a group's logits would change with the number of rows
# read beside it (docs/batch-invariance.md). From 12 rows on, each row's result is the same whatever the count.
HEAD_ROWS = 16


class ReadPlan(NamedTuple):
    """T reads folded into what is distinct (all LongTensors on the reads' device).

    Attributes:
        rows: [R] the distinct logit rows read, sorted.
        pair_row: [P] per distinct (row, target) pair, its row as an index into ``rows`` (non-decreasing).
        pair_target: [P] per pair, its target token.
        reader: [T] per read, its pair (an index into ``pair_row``).
    """

    rows: Tensor
    pair_row: Tensor
    pair_target: Tensor
    reader: Tensor


def read_plan(rows: Tensor, targets: Tensor, device: torch.device | str | None = None) -> ReadPlan:
    """Fold reads ``(rows[t], targets[t])`` (LongTensors [T], rows and targets >= 0) into a :class:`ReadPlan`
    on ``device`` (default: the reads'). The folding reads values (``torch.unique``): given CPU reads it
    never waits on an accelerator, and it also runs where device values cannot be read (fake tensors)."""
    if rows.numel() and int(torch.minimum(rows.min(), targets.min())) < 0:  # one read of the values, not two
        raise ValueError(f"read_plan: logit rows and targets must be >= 0, got rows from {int(rows.min())} and targets "
                         f"from {int(targets.min())} (a negative index would read another row or token)")
    span = int(targets.max()) + 1 if targets.numel() else 1
    pairs, reader = torch.unique(rows * span + targets, return_inverse=True)   # [P] sorted by (row, target)
    distinct, pair_row = torch.unique(pairs // span, return_inverse=True)     # [R], [P]
    plan = ReadPlan(distinct, pair_row, pairs % span, reader)
    return plan if device is None else ReadPlan(*(t.to(device) for t in plan))


def _to_readers(values: Tensor, reader: Tensor) -> Tensor:
    """``values`` [P] copied to the T readers; indexing's backward accumulates, so a pair gets the sum of its
    readers' gradients (the k-fold weight; the exactness tests replace this function to prove they see it)."""
    return values[reader]


def read_scores(logits: Tensor, plan: ReadPlan, temperature: float = 1.0, return_entropy: bool = False,
                chunk_size: int = 4096, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the reads in ``plan`` from ``logits`` divided by ``temperature``.

    Args:
        logits: [n, V] logit rows, any floating dtype; ``plan.rows`` index its rows.
        plan: :func:`read_plan` of the T reads.
        temperature: logits are divided by it before the softmax (checked by the caller, > 0).
        return_entropy: also return the entropy of each read's distribution.
        chunk_size: distinct rows per chunk: no temporary larger than ``[chunk_size, V]``.
        dtype: the softmax's dtype; default the logits' own for float32 / float64, float32 otherwise.

    Returns:
        ``(lp [T], ent [T] or None)`` in ``dtype``: ``lp[t] = log softmax(x / temperature)[target]`` of read
        ``t``'s row ``x``. Differentiable with respect to ``logits`` (both outputs). The entropy is computed
        from the rows shifted by their maximum, as TRL's fused LM head does (unshifted, ``lse - sum(p x)``
        is biased low in float32).
    """
    work = dtype or (logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32)
    rows_fit(plan.rows, logits.shape[0], "read_scores: logits")
    lp, ent = _RowScores.apply(logits, plan.rows, plan.pair_row, plan.pair_target, float(temperature),
                               bool(return_entropy), int(chunk_size), work)
    return to_readers(lp, ent, plan, return_entropy)


def rows_fit(rows: Tensor, n: int, what: str) -> None:
    """Refuse a plan's distinct sorted ``rows`` [R] that index past the ``n`` rows of ``what`` when ``R == n``: the
    readers then slice rows ``0..n-1`` (views, no gather) and would silently read other rows (a gather raises by
    itself). Checked on the device without waiting on it (``torch._assert_async``)."""
    if rows.numel() == n and n:
        torch._assert_async(rows[-1] == n - 1, f"{what} have {n} rows but the read plan reads a row >= {n}: pass "
                                               "the rows the plan indexes (every row up to its largest)")


def _chunks(logits: Tensor, rows: Tensor, chunk: int, temperature: float, work: torch.dtype):
    """Yield ``(a, b, x [b - a, V])``: distinct rows ``rows[a:b]`` in ``work``, divided by ``temperature``.
    Distinct sorted rows as many as ``logits`` has are all of them in order: sliced (views), never gathered."""
    whole = rows.numel() == logits.shape[0]
    for a in range(0, rows.numel(), chunk):
        b = min(a + chunk, rows.numel())
        x = logits[a:b] if whole else logits.index_select(0, rows[a:b])
        x = x.to(work)
        if temperature != 1.0:
            x = x / temperature
        yield a, b, x


def row_sums(g_lp: Tensor | None, pair_row: Tensor, n: int, work: torch.dtype, device) -> Tensor:
    """[n] per row, the sum of its pairs' log-prob gradients: the weight of ``-softmax`` in the row's gradient
    (a branch point's row has several pairs; the exactness tests replace this function to prove they see it)."""
    g_row = torch.zeros(n, dtype=work, device=device)
    return g_row if g_lp is None else g_row.index_add_(0, pair_row, g_lp.to(work))


def to_readers(lp: Tensor, ent: Tensor, plan: ReadPlan, want_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """Per-pair log-probs ``lp`` [P] and per-row entropies ``ent`` [R] copied to the plan's T readers."""
    return _to_readers(lp, plan.reader), (_to_readers(ent[plan.pair_row], plan.reader) if want_entropy else None)


def pair_bounds(pair_row: Tensor, rows: Tensor, chunk: int) -> list[tuple[int, int]]:
    """Per chunk of ``chunk`` distinct rows, its pairs' span ``[pa, pb)`` (``pair_row`` is non-decreasing)."""
    bounds = torch.searchsorted(pair_row, torch.arange(0, rows.numel() + chunk, chunk, device=pair_row.device)).tolist()
    return list(zip(bounds, bounds[1:]))


def score_chunk(x: Tensor, a: int, b: int, pa: int, pb: int, pair_row: Tensor, pair_target: Tensor, lse: Tensor,
                lp: Tensor, ent: Tensor | None) -> None:
    """Forward of one chunk: ``x`` [b - a, V] the scaled rows ``rows[a:b]``; fills ``lse[a:b]``, ``lp[pa:pb]``
    (the chunk's pairs) and, given ``ent`` [R], ``ent[a:b]``."""
    lse[a:b] = torch.logsumexp(x, dim=-1)
    r = pair_row[pa:pb] - a
    lp[pa:pb] = x[r, pair_target[pa:pb]] - lse[a:b][r]
    if ent is not None:
        e = (z := x - x.amax(-1, keepdim=True)).exp()                  # log S - sum(e z) / S, S = sum(e)
        s = e.sum(-1)
        ent[a:b] = s.log() - (e * z).sum(-1) / s


def grad_chunk(x: Tensor, a: int, b: int, pa: int, pb: int, pair_row: Tensor, pair_target: Tensor, lse: Tensor,
               ent: Tensor, g_row: Tensor, g_lp: Tensor | None, g_ent: Tensor | None, out: Tensor | None = None
               ) -> Tensor:
    """Backward of one chunk: the gradient [b - a, V] with respect to the scaled rows ``x`` (written into
    ``out`` when given): ``-p * (g_row + g_ent * (log p + ent))`` plus each pair's ``g_lp`` at its target."""
    gz = torch.sub(x, lse[a:b, None], out=out)                        # [c, V] log p
    if g_ent is not None:   # -p * (g_row + g_ent * (log p + ent))
        w = (gz + ent[a:b, None]).mul_(g_ent[a:b, None].to(x.dtype)).add_(g_row[a:b, None])
        gz.exp_().mul_(w).neg_()
    else:                   # -p * g_row
        gz.exp_().mul_(-g_row[a:b, None])
    if g_lp is not None:
        gz.index_put_((pair_row[pa:pb] - a, pair_target[pa:pb]), g_lp[pa:pb].to(x.dtype), accumulate=True)
    return gz


class _RowScores(torch.autograd.Function):
    """``(lp [P], ent [R] or [0])``: per distinct pair its log-prob, per distinct row its entropy.

    Gradients, per row ``z = x / tau`` with ``p = softmax(z)``, summed over the row's pairs ``j``:
    ``d lp_j / dz = onehot(target_j) - p``; ``d ent / dz = -p * (log p + ent)``; then ``/ tau``.
    """

    @staticmethod
    def forward(ctx, logits, rows, pair_row, pair_target, temperature, want_entropy, chunk, work):
        lse = torch.empty(rows.numel(), dtype=work, device=logits.device)                       # [R]
        ent = torch.empty(rows.numel() if want_entropy else 0, dtype=work, device=logits.device)  # [R] or [0]
        lp = torch.empty(pair_row.numel(), dtype=work, device=logits.device)                    # [P]
        for (a, b, x), (pa, pb) in zip(_chunks(logits, rows, chunk, temperature, work), pair_bounds(pair_row, rows, chunk)):
            score_chunk(x, a, b, pa, pb, pair_row, pair_target, lse, lp, ent if want_entropy else None)
        ctx.save_for_backward(logits, rows, pair_row, pair_target, lse, ent)
        ctx.settings = (temperature, want_entropy, chunk, work)
        ctx.mark_non_differentiable(*(() if want_entropy else (ent,)))
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, rows, pair_row, pair_target, lse, ent = ctx.saved_tensors
        temperature, want_entropy, chunk, work = ctx.settings
        whole = rows.numel() == logits.shape[0]
        in_place = whole and logits.dtype == work        # each chunk's gradient is written straight into grad
        grad = torch.empty_like(logits) if whole else torch.zeros_like(logits)
        g_row = row_sums(g_lp, pair_row, rows.numel(), work, logits.device)   # [R]
        g_ent = g_ent if want_entropy else None
        for (a, b, x), (pa, pb) in zip(_chunks(logits, rows, chunk, temperature, work), pair_bounds(pair_row, rows, chunk)):
            gz = grad_chunk(x, a, b, pa, pb, pair_row, pair_target, lse, ent, g_row, g_lp, g_ent,
                            out=grad[a:b] if in_place else None)
            if temperature != 1.0:
                gz.div_(temperature)
            if in_place:
                continue
            if whole:
                grad[a:b] = gz
            else:
                grad.index_copy_(0, rows[a:b], gz.to(grad.dtype))
        return grad, None, None, None, None, None, None, None
