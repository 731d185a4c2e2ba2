"""verify's calibration: what rounding a float32 (or bf16) verdict is judged against.

- :func:`choose`: ``"float64"`` (a float64 copy of the stock model, the truth), ``"layerwise"`` (the
  same truth from the stock float32 copy itself, one block's weights in float64 at a time:
  :mod:`flexgroup.reference.layerwise`), ``"spread"`` (the stock model's own spread between evaluation orders)
  or ``"none"`` for verify's arguments, with a note why; :func:`choose_by_memory` decides ``"auto"``
  from what verify's runs measurably took and what the process may still allocate: float64 where
  the copy fits, else layerwise where its truth fits, else none;
- :class:`Float64Reference`: each sequence alone through that truth (either kind);
- :func:`stock_spread`: the spread -- each sequence alone against the same stock model run other ways;
- :func:`sequence_backward` / :func:`read_logprobs`: one sequence alone through a stock copy, the unit
  both the baseline and the calibration runs are made of.

The verdict rule itself (flexgroup's error within a factor of the stock run's own) is applied by
:mod:`flexgroup.verification.equivalence`.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..reference.layerwise import blocks, float64_by_layer, float64_scope
from .memory import headroom, size as _size
from ..reference.oracle import logits_alone, logprobs_of

__all__ = ["CALIBRATIONS", "choose", "choose_by_memory", "float64_budget", "Float64Reference", "stock_spread", "sequence_backward",
           "read_logprobs"]

CALIBRATIONS = ("auto", "float64", "layerwise", "spread", "none")
_REFERENCE_BYTES = 4 * 2**30  # the float64 copy "auto" allows at least (and where the memory is unknown)
_SPREAD_CHUNK = 8  # sequences per padded batch of the spread calibration


def choose(calibration: str, model: torch.nn.Module, device: torch.device,
           dtype: torch.dtype, float64_bytes: int | None) -> tuple[str, str | None]:
    """(``"float64"`` | ``"layerwise"`` | ``"spread"`` | ``"none"`` | ``"auto"``, a note saying why) for
    verify's arguments. ``"auto"`` comes back only on CPU: verify decides it with
    :func:`choose_by_memory` once it has measured its own runs."""
    if calibration not in CALIBRATIONS:
        raise ValueError(f"verify: calibration={calibration!r}: choose one of {CALIBRATIONS}")
    if dtype == torch.float64:
        return "none", None if calibration in ("auto", "none") else (
            f"calibration={calibration!r} skipped: the run is float64 already (fixed tolerances)")
    if calibration != "auto":
        return calibration, None
    if device.type != "cpu":
        return "layerwise", (f"calibration auto -> layerwise: the model is on {device.type}, where no float64 copy is "
                             "made (calibration='float64' forces one)")
    return "auto", None


def _largest_block(model: torch.nn.Module) -> int:
    """Parameters of the largest block :func:`flexgroup.reference.layerwise.blocks` casts to float64 at a time."""
    return max((sum(p.numel() for p in b.parameters()) for b in blocks(model)), default=0)


def choose_by_memory(model: torch.nn.Module, dtype: torch.dtype, activations: int | None,
                     float64_bytes: int | None = None) -> tuple[str, str | None]:
    """verify's ``"auto"`` on CPU: ``(calibration, note)`` from measured numbers, called once verify
    holds the grouped and the baseline gradients, with ``activations`` the larger measured peak of its
    runs (:class:`flexgroup.verification.memory.Peak`, less their gradients; None where not measurable).

    What each truth adds now, against :func:`flexgroup.verification.memory.headroom` (keeping a fifth spare):
    float64 -- its copy (8 bytes a parameter), its gradient sums (float32, one per trainable
    parameter), float64 activations (2x the measured ones) and the largest parameter's float64
    gradient (each is added into its sum and dropped); layerwise -- the sums, the float64 activations,
    that gradient and the largest block's weights in float64. The first that fits, else ``"none"`` with a note
    naming the numbers and the ways out. ``float64_bytes`` caps the copy as before (then layerwise).
    """
    n_all = sum(p.numel() for p in model.parameters())
    sums = sum(p.numel() for p in model.parameters() if p.requires_grad) * torch.finfo(
        torch.promote_types(dtype, torch.float32)).bits // 8
    act = 2 * (activations or 0)
    copy = 8 * n_all
    grad64 = 8 * max((p.numel() for p in model.parameters() if p.requires_grad), default=0)  # one float64 gradient
    need = {"float64": copy + sums + act + grad64, "layerwise": sums + act + grad64 + 8 * _largest_block(model)}
    room, how = headroom()
    measured = "not measured" if activations is None else f"measured {_size(activations)}"
    if room is None:  # nothing says how much memory there is: the older rule, said so
        limit = _REFERENCE_BYTES if float64_bytes is None else float64_bytes
        if copy <= limit:
            return "float64", f"calibration auto -> float64: {how}; the copy ({_size(copy)}) is under {_size(limit)}"
        return "layerwise", f"calibration auto -> layerwise: {how}; a float64 copy ({_size(copy)}) is over {_size(limit)}"
    spare = 0.8 * room
    over_limit = float64_bytes is not None and copy > float64_bytes
    if not over_limit and need["float64"] <= spare:
        return "float64", None
    why = (f"a float64 copy would take {_size(copy)}, over the {_size(float64_bytes)} limit (given)" if over_limit else
           f"the float64 copy would add {_size(need['float64'])} (copy {_size(copy)}, gradient sums {_size(sums)}, "
           f"float64 activations {_size(act)} -- activations {measured} --, one float64 gradient {_size(grad64)}) "
           f"where {how}")
    if need["layerwise"] <= spare:
        return "layerwise", (f"calibration auto -> layerwise: {why}; the float64 truth is computed one block's "
                             "weights at a time instead (calibration='float64' forces the copy)")
    return "none", (f"calibration auto -> none: {why}, and the layerwise truth would still add "
                    f"{_size(need['layerwise'])}: fixed tolerances only. Free memory, freeze parameters "
                    "(--freeze-embeddings), or force calibration='layerwise'")


def float64_budget() -> tuple[int | None, str]:
    """What verify may still allocate now (:func:`flexgroup.verification.memory.headroom`): ``(bytes or None, how)``."""
    return headroom()


def sequence_backward(model, seq: torch.Tensor, r: int, read: torch.Tensor, weight: torch.Tensor,
                      extra: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence alone: backward of ``weight * sum of its read log-probs``.

    ``seq`` [S]; its last ``r`` positions are the row's output columns, ``read`` [r] bool the columns
    the batch reads (its ``response_mask`` row; never sequence position 0); ``extra``: the sequence's
    other model inputs (``batch.sequence_inputs(i)``: its images). Returns (logits [S, V], log-probs
    [r] with 0 at unread columns), detached. With every parameter frozen there is no backward (the
    report then says no gradient was compared).
    """
    logits = logits_alone(model, seq, **(extra or {}))  # [S, V], the shared oracle
    lp = read_logprobs(logits, seq, r, read)
    loss = weight.to(lp.dtype) * lp.sum()
    if loss.requires_grad:
        loss.backward()
    return logits.detach(), lp.detach()


def read_logprobs(logits: torch.Tensor, seq: torch.Tensor, r: int, read: torch.Tensor) -> torch.Tensor:
    """Log-probs [r] of the last ``r`` positions of ``seq`` [S] from its ``logits`` [S, V] (0 where not
    ``read``; position 0 has none). Only the rows that predict those positions go through the
    log-softmax: a long prompt with a large vocabulary costs no [S, V] temporaries."""
    start = max(seq.numel() - r, 1)                      # first position with a log-prob
    lp = logprobs_of(logits[start - 1:], seq[start - 1:])  # positions start .. S-1
    lp = torch.cat([lp.new_zeros(r - lp.numel()), lp])   # [r], column c = position S - r + c
    return torch.where(read, lp, 0)


class Float64Reference:
    """Each sequence alone through the float64 truth of the stock model (verify's calibrations
    ``"float64"`` and ``"layerwise"``).

    ``"float64"``: ``make_copy()`` builds a float64 stock copy, run under
    :func:`flexgroup.reference.layerwise.float64_scope` (HF's norms, softmaxes and linear-attention scans ask for
    float32 even in a float64 model; there they stay float64). Each of its parameters' float64
    gradients is added, as soon as it is accumulated, into a sum in the baseline's gradient dtype (at
    least float32) and dropped: the copy never holds a full float64 gradient set. ``"layerwise"``:
    ``base``, the stock copy the baseline runs on, is run under
    :func:`flexgroup.reference.layerwise.float64_by_layer`; its ``.grad`` is swapped around each run, so the
    baseline's gradients and the truth's stay apart. Either way the truth's gradients are the float64
    ones rounded once per sequence (float32: relative 6e-8, far below the float32 noise it calibrates).
    """

    def __init__(self, kind: str, base: torch.nn.Module, make_copy: Callable[[], torch.nn.Module]):
        if kind not in ("float64", "layerwise"):
            raise ValueError(f"Float64Reference: kind={kind!r}: 'float64' or 'layerwise'")
        self.kind = kind
        self.model = make_copy() if kind == "float64" else base
        self._grads: dict[str, torch.Tensor | None] = {k: None for k, _ in self.model.named_parameters()}
        if kind == "float64":
            dtypes = {k: torch.promote_types(p.dtype, torch.float32) for k, p in base.named_parameters()}
            for k, p in self.model.named_parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._sum_into(k, dtypes[k]))

    def _sum_into(self, name: str, dtype: torch.dtype):
        def hook(p: torch.Tensor) -> None:
            if self._grads[name] is None:
                self._grads[name] = p.grad.to(dtype)
            else:
                self._grads[name].add_(p.grad.to(self._grads[name].dtype))   # no float64 temporary
            p.grad = None
        return hook

    def run(self, seq: torch.Tensor, r: int, read: torch.Tensor, weight: torch.Tensor,
            extra: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`sequence_backward` through the truth: (logits [S, V], log-probs [r]), float64."""
        if self.kind == "float64":
            with float64_scope():
                return sequence_backward(self.model, seq, r, read, weight, extra)
        params = dict(self.model.named_parameters())
        theirs = {k: p.grad for k, p in params.items()}
        for k, p in params.items():
            p.grad = self._grads[k]
        try:
            with float64_by_layer(self.model):
                return sequence_backward(self.model, seq, r, read, weight, extra)
        finally:
            for k, p in params.items():
                self._grads[k], p.grad = p.grad, theirs[k]

    def release(self) -> None:
        """Drop the float64 copy (its gradient sums stay); a layerwise truth holds no copy."""
        if self.kind == "float64":
            self.model = None

    def grads(self) -> dict[str, torch.Tensor | None]:
        """``{name: gradient}`` of the truth's runs so far (float64: float32 sums; layerwise: the parameters' dtype)."""
        return dict(self._grads)


def stock_spread(base: torch.nn.Module, base_impl: str, batch, mask: torch.Tensor, adv: torch.Tensor, n: int,
                  lp_b: torch.Tensor, param_errors: Callable) -> tuple[float, float, dict[str, tuple[float, float]], list[str]]:
    """The stock model's own spread between evaluation orders, against each sequence run alone.

    Two other orders, both the stock model: the batch's sequences right-padded (``_SPREAD_CHUNK`` per
    forward, ``attention_mask`` marking the padding), and each sequence alone through the other stock
    attention implementation (``eager`` <-> ``sdpa``) where that one also computes the config exactly.
    On CPU a padded row is computed almost bit for bit like the row alone (matmul rows do not depend on
    their neighbours), so the padded batch alone would understate the noise: the attention kernels'
    rounding is what a grouped run changes. ``base``: the stock copy after the each-alone runs (its
    ``.grad`` holds their gradients, kept); ``lp_b`` [N, max_len] their log-probs. Same loss as the
    baseline. Returns (max |logits diff|, max |log-prob diff| over read tokens, ``{param: (abs, rel)}``
    -- each the max over the orders -- and the orders' names).
    """
    from ..reference.stock import stock_attention

    if hasattr(batch, "sequence_inputs"):  # a floor measured without the images would be no floor at all
        raise NotImplementedError("the spread's padded batch carries no images or videos: use calibration='layerwise'")
    params = dict(base.named_parameters())
    alone = {k: p.grad for k, p in params.items()}
    seqs = [batch.input_ids[path].to(mask.device) for path in batch.paths]
    alt = {"sdpa": "eager", "eager": "sdpa"}.get(base_impl)
    if alt == "sdpa" and stock_attention(base.config) != "sdpa":
        alt = None  # e.g. softcapping: stock sdpa would compute another function, not another order
    e_logits, e_lp, grads, names = 0.0, 0.0, {}, []
    try:
        for order in ["padded batch"] + ([f"{alt} attention"] if alt else []):
            for p in params.values():
                p.grad = None
            lp_o = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
            if order == "padded batch":
                e = _padded_run(base, batch, seqs, mask, adv, n, lp_o)
            else:
                e = _other_attention_run(base, base_impl, alt, batch, seqs, mask, adv, n, lp_o)
            e_logits = max(e_logits, e)
            e_lp = max(e_lp, float(torch.where(mask, (lp_o - lp_b.double()).abs(), 0).max()))
            for k, (ab, rel) in param_errors({k: p.grad for k, p in params.items()}, alone)[0].items():
                old = grads.get(k, (0.0, 0.0))
                grads[k] = (max(old[0], ab), max(old[1], rel))
            names.append(order)
    finally:
        base.set_attn_implementation(base_impl) if base.config._attn_implementation != base_impl else None
        for k, p in params.items():
            p.grad = alone[k]
    return e_logits, e_lp, grads, names


def _padded_run(base, batch, seqs, mask, adv, n, lp_o: torch.Tensor) -> float:
    """Backward of the baseline loss over right-padded chunks; fills ``lp_o``; max |logits - alone|."""
    e_logits = 0.0
    for start in range(0, len(seqs), _SPREAD_CHUNK):
        idx = range(start, min(len(seqs), start + _SPREAD_CHUNK))
        S = max(seqs[i].numel() for i in idx)
        x = torch.zeros(len(idx), S, dtype=torch.long, device=mask.device)
        am = torch.zeros_like(x)
        for j, i in enumerate(idx):
            x[j, :seqs[i].numel()], am[j, :seqs[i].numel()] = seqs[i], 1
        out = base(input_ids=x, attention_mask=am, use_cache=False).logits  # [c, S, V]
        loss = out.new_zeros((), dtype=torch.float64)
        for j, i in enumerate(idx):
            s, r = seqs[i].numel(), batch.response_lengths[i]
            lp = read_logprobs(out[j, :s], seqs[i], r, mask[i, :r])
            lp_o[i, :r] = lp.detach().double()
            loss = loss + (-adv[i] / n) * lp.double().sum()
            with torch.no_grad():
                e_logits = max(e_logits, float((out[j, :s].detach().double()
                                                - logits_alone(base, seqs[i]).double()).abs().max()))
        loss.backward()
    return e_logits


def _other_attention_run(base, impl, alt, batch, seqs, mask, adv, n, lp_o: torch.Tensor) -> float:
    """Each sequence alone through stock attention ``alt`` instead of ``impl``; fills ``lp_o``; max |logits diff|."""
    e_logits = 0.0
    for i, seq in enumerate(seqs):
        base.set_attn_implementation(impl)
        with torch.no_grad():
            want = logits_alone(base, seq).double()
        base.set_attn_implementation(alt)
        r = batch.response_lengths[i]
        logits, lp_o[i, :r] = sequence_backward(base, seq, r, mask[i, :r], -adv[i] / n)
        e_logits = max(e_logits, float((logits.double() - want).abs().max()))
    return e_logits
