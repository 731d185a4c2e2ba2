"""The shared readout (:mod:`flexgroup.data.readout`) read straight from the final hidden states and the LM head.

At a real vocabulary the logits are the largest tensor of a step: ``[rows, V]`` float32 at V = 151,936 is
0.6 MB per row, held for backward. :func:`read_scores_fused` computes the same values as
``read_scores(head(hidden), plan, ...)`` -- the same :class:`~flexgroup.data.readout.ReadPlan` (each distinct
row's log-sum-exp once, each distinct (row, target) pair once, its gradient weighted by its readers), the
same per-chunk arithmetic (:func:`~flexgroup.data.readout.score_chunk`, :func:`~flexgroup.data.readout.grad_chunk`)
-- but each chunk's logits are computed from the chunk's hidden rows and dropped; backward recomputes them
chunk by chunk (as fused linear cross-entropy kernels do). Saved for backward: the hidden states, the head's
weight and bias (the caller's tensors, no copy), ``lse [R]`` (and ``ent [R]``) and the plan's indices.
Peak beyond that: a few ``[chunk, V]`` temporaries, and in backward one ``[V, H]`` weight gradient
(float32 when the weight is half precision, so that the chunks' sum is not rounded per chunk).

:func:`hidden_forward` runs a Hugging Face causal LM for its last hidden states (the LM head runs on one row,
a check that the head this module applies is the model's own: a transform of the logits it does not know
raises) and returns them with the :class:`LMHead`.

No transformers import here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import readout
from .readout import HEAD_ROWS, ReadPlan, grad_chunk, pair_bounds, rows_fit, score_chunk

__all__ = ["LMHead", "lm_head_of", "hidden_forward", "read_scores_fused"]

Tensor = torch.Tensor
CHUNK_ELEMENTS = 1 << 26   # default chunk: rows * V <= 2**26 (256 MiB per float32 temporary)


class LMHead(NamedTuple):
    """The map from a final hidden state to its logits: ``softcap(scale * (h @ weight.T + bias))``.

    Attributes:
        weight: [V, H] the LM head's weight (the model's own tensor).
        bias: [V] or None.
        scale: logits are multiplied by it (Cohere's ``logit_scale``; ``1 / logits_scaling`` for Granite).
        softcap: None, or ``c``: then ``c * tanh(x / c)`` after the scale (Gemma 2's ``final_logit_softcapping``).
    """

    weight: Tensor
    bias: Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None


def lm_head_of(model: torch.nn.Module) -> LMHead:
    """The :class:`LMHead` of a Hugging Face causal LM: ``model.get_output_embeddings()`` (a plain
    ``nn.Linear``) and the config's logit transforms (``final_logit_softcapping``, ``logit_scale``,
    ``logits_scaling``). Anything else raises, naming what was found."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not torch.nn.Linear:
        raise NotImplementedError(
            f"fused readout: {type(model).__name__}'s output embeddings are {type(head).__name__}, not a plain "
            "torch.nn.Linear (an adapter on the LM head, a custom head): use the unfused readout (fused=False)")
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    scale = float(getattr(text, "logit_scale", None) or 1.0)
    if getattr(text, "logits_scaling", None):
        scale /= float(text.logits_scaling)
    return LMHead(head.weight, head.bias, scale, float(cap) if cap else None)


def hidden_forward(model: torch.nn.Module, inputs: dict) -> tuple[Tensor, LMHead]:
    """``model(**inputs)``'s final hidden states in place of its logits: ``(hidden [1, K, H], head)``. A wrapper
    with a ``.module`` (DDP, accelerate) is called as it is; its module gives the head and the decoder.

    ``K`` and the rows are those the logits would have had: every position, or ``inputs["logits_to_keep"]``'s
    (a LongTensor of rows, as ``GroupedBatch.model_inputs(needed_logits_only=True)`` passes). The model runs
    with ``logits_to_keep`` = its last position only; that one logit row is checked against ``head`` applied to
    the last hidden state (a logit transform that :func:`lm_head_of` does not read raises, naming the gap).
    """
    inner = model.module if isinstance(getattr(model, "module", None), torch.nn.Module) else model
    head = lm_head_of(inner)
    decoder = inner.get_decoder() if callable(getattr(inner, "get_decoder", None)) else None
    if not isinstance(decoder, torch.nn.Module):
        raise NotImplementedError(f"fused readout: {type(model).__name__} has no get_decoder() module whose output is "
                                  "the final hidden states: use the unfused readout (fused=False)")
    keep = inputs.get("logits_to_keep")
    if keep is not None and not isinstance(keep, Tensor) and keep != 0:
        raise ValueError(f"fused readout: logits_to_keep={keep!r}: pass a LongTensor of rows (or none)")
    seen: list[Tensor] = []
    hook = decoder.register_forward_hook(lambda m, a, out: seen.append(out[0]))
    try:
        n = inputs["input_ids"].shape[-1]
        out = model(**{**inputs, "logits_to_keep": torch.tensor([n - 1], device=inputs["input_ids"].device)})
    finally:
        hook.remove()
    if len(seen) != 1 or seen[0].ndim != 3:
        raise NotImplementedError(f"fused readout: {type(model).__name__}'s decoder ran {len(seen)} times or returned "
                                  "no [1, L, H] hidden states: use the unfused readout (fused=False)")
    hidden = seen[0]
    w = head.weight
    if type(w).__name__ == "DTensor" or w.ndim != 2 or w.shape[1] != hidden.shape[-1]:
        raise NotImplementedError(
            f"fused readout: {type(model).__name__}'s LM head weight is {type(w).__name__} {tuple(w.shape)} after the "
            f"forward, not [V, {hidden.shape[-1]}]: it is sharded outside the forward (FSDP, DeepSpeed ZeRO-3), and the "
            "fused readout reads it after the forward; use the unfused readout (fused=False)")
    _check_head(head, hidden[0, -1:], out.logits[0, -1:], type(model).__name__)
    return (hidden if keep is None or not isinstance(keep, Tensor) else hidden[:, keep.to(hidden.device)]), head


def _check_head(head: LMHead, h: Tensor, logits: Tensor, name: str) -> None:
    """Refuse when ``head`` applied to ``h`` [1, H] is not the model's own logit row ``logits`` [1, V], beyond a
    few roundings of the coarsest dtype involved (the logits', the hidden states', the weight's, autocast's)."""
    kind = logits.device.type
    dtypes = [logits.dtype, h.dtype, head.weight.dtype]
    if torch.is_autocast_enabled(kind):
        dtypes.append(torch.get_autocast_dtype(kind))
    with torch.no_grad():
        mine = _logits(h, head, logits.dtype).to(torch.float64)
        theirs = logits.to(torch.float64)
        tol = 4 * max(torch.finfo(d).eps for d in dtypes) * float(theirs.abs().max().clamp_min(1.0))
        err = float((mine - theirs).abs().max())
    if not err <= tol:
        raise NotImplementedError(
            f"fused readout: {name}'s logits are not softcap(scale * lm_head(hidden)) with {head.scale=}, "
            f"{head.softcap=} (largest difference {err:.3g} > {tol:.3g} on the last row): its forward transforms the "
            "hidden states or logits in a way flexgroup.data.fused_readout does not know; use the unfused readout "
            "(fused=False)")


def _logits(h: Tensor, head: LMHead, work: torch.dtype) -> Tensor:
    """``softcap(scale * (h @ W.T + b))`` [c, V] in ``work``: the matmul in the weight's dtype, the rest in ``work``."""
    n = h.shape[0]
    if n < HEAD_ROWS:  # a chunk's tail of a few rows: the matmul on HEAD_ROWS rows, so its kernel is the others'
        h = torch.cat([h, h.new_zeros(HEAD_ROWS - n, h.shape[1])])
    x = F.linear(h.to(head.weight.dtype), head.weight, head.bias)[:n].to(work)
    if head.scale != 1.0:
        x = x * head.scale
    if head.softcap is not None:
        x = torch.tanh(x / head.softcap) * head.softcap
    return x


def read_scores_fused(hidden: Tensor, head: LMHead, plan: ReadPlan, temperature: float = 1.0,
                      return_entropy: bool = False, chunk_size: int | None = None, dtype: torch.dtype | None = None
                      ) -> tuple[Tensor, Tensor | None]:
    """:func:`flexgroup.data.readout.read_scores` of the logits ``head(hidden)``, never holding them.

    Args:
        hidden: [n, H] final hidden states; ``plan.rows`` index its rows.
        head: the :class:`LMHead` (weight [V, H], bias [V] or None, scale, softcap).
        plan: :func:`flexgroup.data.readout.read_plan` of the T reads.
        temperature: the (scaled, capped) logits are divided by it before the softmax (> 0, checked by the caller).
        return_entropy: also return each read's entropy.
        chunk_size: distinct rows per chunk; default ``max(1, 2**26 // V)`` (256 MiB per float32 temporary).
        dtype: the softmax's dtype; default the weight's own for float32 / float64, float32 otherwise.

    Returns:
        ``(lp [T], ent [T] or None)`` in ``dtype``, as ``read_scores``. Differentiable with respect to
        ``hidden``, ``head.weight`` and ``head.bias``.
    """
    if head.softcap is not None and not head.softcap > 0:
        raise ValueError(f"read_scores_fused: softcap must be > 0 or None, got {head.softcap!r}")
    w = head.weight
    if hidden.ndim != 2 or w.ndim != 2 or hidden.shape[1] != w.shape[1]:
        raise ValueError(f"read_scores_fused: hidden [n, H] and weight [V, H] expected, got {tuple(hidden.shape)} "
                         f"and {tuple(w.shape)}")
    work = dtype or (w.dtype if w.dtype in (torch.float32, torch.float64) else torch.float32)
    rows_fit(plan.rows, hidden.shape[0], "read_scores_fused: hidden states")
    chunk = int(chunk_size) if chunk_size is not None else max(1, CHUNK_ELEMENTS // w.shape[0])
    bias = head.bias if head.bias is not None else w.new_zeros(0)
    lp, ent = _FusedRowScores.apply(hidden, w, bias, plan.rows, plan.pair_row, plan.pair_target, float(temperature),
                                    bool(return_entropy), chunk, work, float(head.scale), head.softcap)
    return readout.to_readers(lp, ent, plan, return_entropy)


def _hidden_chunks(hidden: Tensor, rows: Tensor, chunk: int):
    """Yield ``(a, b, h [b - a, H])``: the hidden rows ``rows[a:b]`` (a view when every row is read, in order)."""
    whole = rows.numel() == hidden.shape[0]
    for a in range(0, rows.numel(), chunk):
        b = min(a + chunk, rows.numel())
        yield a, b, (hidden[a:b] if whole else hidden.index_select(0, rows[a:b]))


class _FusedRowScores(torch.autograd.Function):
    """``(lp [P], ent [R] or [0])`` from the hidden states, as ``readout._RowScores`` from the logits.

    Per chunk, ``x = h W^T + b``, ``y = scale x``, ``u = softcap(y)``, ``z = u / tau``; backward recomputes
    ``z``, takes ``dL/dz`` from :func:`~flexgroup.data.readout.grad_chunk`, then
    ``dL/dx = dL/dz / tau * (1 - tanh^2(y / c)) * scale`` and ``dL/dh = dL/dx W``, ``dL/dW += dL/dx^T h``,
    ``dL/db += sum_rows dL/dx``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, pair_row, pair_target, temperature, want_entropy, chunk, work,
                scale, softcap):
        head = LMHead(weight, bias if bias.numel() else None, scale, softcap)
        lse = torch.empty(rows.numel(), dtype=work, device=hidden.device)                        # [R]
        ent = torch.empty(rows.numel() if want_entropy else 0, dtype=work, device=hidden.device)  # [R] or [0]
        lp = torch.empty(pair_row.numel(), dtype=work, device=hidden.device)                     # [P]
        for (a, b, h), (pa, pb) in zip(_hidden_chunks(hidden, rows, chunk), pair_bounds(pair_row, rows, chunk)):
            z = _logits(h, head, work)
            if temperature != 1.0:
                z = z / temperature
            score_chunk(z, a, b, pa, pb, pair_row, pair_target, lse, lp, ent if want_entropy else None)
        ctx.save_for_backward(hidden, weight, bias, rows, pair_row, pair_target, lse, ent)
        ctx.settings = (temperature, want_entropy, chunk, work, scale, softcap)
        ctx.mark_non_differentiable(*(() if want_entropy else (ent,)))
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, rows, pair_row, pair_target, lse, ent = ctx.saved_tensors
        temperature, want_entropy, chunk, work, scale, softcap = ctx.settings
        head = LMHead(weight, bias if bias.numel() else None, scale, None)   # softcap: applied below, with its chain
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        whole = rows.numel() == hidden.shape[0]
        g_hidden = (torch.empty_like(hidden) if whole else torch.zeros_like(hidden)) if need_h else None
        acc = work if weight.dtype not in (torch.float32, torch.float64) else weight.dtype
        g_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        g_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b and bias.numel() else None
        g_row = readout.row_sums(g_lp, pair_row, rows.numel(), work, hidden.device)   # [R]
        g_ent = g_ent if want_entropy else None
        for (a, b, h), (pa, pb) in zip(_hidden_chunks(hidden, rows, chunk), pair_bounds(pair_row, rows, chunk)):
            y = _logits(h, head, work)                                       # [c, V] scale * x
            t = torch.tanh(y / softcap) if softcap is not None else None
            z = t * softcap if t is not None else y
            if temperature != 1.0:
                z = z / temperature
            gx = grad_chunk(z, a, b, pa, pb, pair_row, pair_target, lse, ent, g_row, g_lp, g_ent, out=z)  # dL/dz
            if temperature != 1.0:
                gx.div_(temperature)
            if t is not None:
                gx.mul_(1 - t * t)
            if scale != 1.0:
                gx.mul_(scale)                                               # [c, V] dL/dx
            gx = gx.to(weight.dtype)
            if g_hidden is not None:
                gh = (gx @ weight).to(hidden.dtype)                          # [c, H]
                if whole:
                    g_hidden[a:b] = gh
                else:
                    g_hidden.index_copy_(0, rows[a:b], gh)
            if g_weight is not None:
                g_weight.addmm_(gx.t().to(acc), h.to(acc))                   # [V, H]
            if g_bias is not None:
                g_bias += gx.sum(0).to(acc)
        return (g_hidden, g_weight.to(weight.dtype) if g_weight is not None else None,
                g_bias.to(bias.dtype) if g_bias is not None else None) + (None,) * 9
