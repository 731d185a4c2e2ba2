"""Equivalence check on any model: grouped forward/backward versus the repeated-prefix baseline.

The baseline is the independent oracle: every root-to-leaf sequence ``[P; R_i]`` of the batch is
run **alone** through a deep copy of the **unpatched** model (stock attention, its own deep-copied
config). The grouped side runs the packed row once through a patched deep copy. Neither copy
touches the caller's model. Compared:

- ``logits`` at every position of every sequence (prompt positions included);
- ``log-probs`` of every response token, ``[N, max_len]`` (``batch.logprobs`` vs. a log-softmax of
  the baseline's own logits);
- every parameter gradient of the loss ``-sum_i A_i * sum_t logp[i, t] / N`` with fixed
  pseudo-random advantages ``A_i``.

Calibrated verdict. Deep real models in float32 differ from *any* other evaluation order by more
than a fixed tolerance (a 30-layer checkpoint: log-probs 3e-5, norm-weight gradients 1e-3
relative) -- the stock model run alone is no closer to the exact result. So where it fits (CPU,
the model's float64 copy fits in the memory available) a float64 run of the stock model is the
truth: a quantity passes when it is within its fixed tolerance of the stock run, or when
flexgroup's error against the float64 truth is within ``_FACTOR`` of the stock run's own error
(gradients: per parameter tensor). The report prints both errors. A real bug (a leaky mask) is
orders of magnitude above that noise floor and still fails.

Calibration (``calibration=``, the CLI's ``--calibration``): ``"float64"`` as above; ``"layerwise"``: the
same float64 truth without a copy -- the stock float32 copy itself run in float64, one block's weights
at a time (:mod:`flexgroup.reference.layerwise`; both keep in float64 the norms, softmaxes and scans that HF runs
in float32 even in a float64 model); ``"spread"``: the stock model's own spread between evaluation orders (padded batch,
the other stock attention) as the noise floor -- weaker: on real checkpoints it understates the
norm-weight gradient noise about 10x (SmolLM2: 3e-5 where the stock run is 3e-4 from float64), so a
correct run can fail it; ``"none"``: fixed tolerances only; ``"auto"`` (default): on CPU, decided after
the grouped run and the longest sequence's baseline run, from what they measurably took
(:func:`flexgroup.verification.calibration.choose_by_memory`): float64 where the copy fits, else layerwise where its
truth fits, else none, saying why. The report says which was used and why (``VerifyReport.calibration``,
a note, the table).

Memory. Both float32 copies share the caller's weights (:func:`flexgroup.reference.oracle.own_copy` with
``share_parameters``: no weights are copied); the grouped run's graph is freed before the baseline
runs; gradients are compared parameter by parameter, a chunk at a time. So verify holds, beside the
caller's model of ``M`` bytes: two gradient sets (grouped, baseline; each at most ``M``) and one
sequence's activations with calibration none (3 M in all); a third gradient set (the truth's, kept
in float32) and float64 activations with layerwise (4 M); the float64 copy's weights (2 M) on top with
float64.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from .calibration import CALIBRATIONS, Float64Reference, choose as _calibration, choose_by_memory
from .calibration import read_logprobs as _read_logprobs, sequence_backward as _path_run, stock_spread
from .memory import Peak
from ..reference.model_checks import check_materialized
from ..reference.oracle import CallerState, own_copy
from .report import FACTOR as _FACTOR, Difference, VerifyReport, calibrate as _calibrate
from .report import nothing_compared as _nothing_compared

__all__ = ["verify", "VerifyReport", "Difference", "default_tolerances", "grad_difference"]

# logits / log-probs: max abs difference; grads: max over parameters of max|dg| / max|g_base|.
_TOLERANCES = {
    torch.float64: {"logits": 1e-5, "logprobs": 1e-5, "grads": 1e-5},  # HF norms and eager softmax run in f32
    torch.float32: {"logits": 1e-4, "logprobs": 1e-5, "grads": 1e-4},
    torch.bfloat16: {"logits": 0.1, "logprobs": 0.1, "grads": 0.1},  # 8-bit mantissa
    torch.float16: {"logits": 0.05, "logprobs": 0.05, "grads": 0.05},
}
_IMPLAUSIBLE = 1e4  # a float64 truth farther than this x eps x max|logits| from the stock run is not used
_CHUNK = 1 << 20  # gradient entries compared at a time (8 MiB in float64): no full-size float64 temporaries


def computes_gradients(fn: Callable) -> Callable:
    """Decorator for self-contained checks that run their own backward (verify): inside, gradients are enabled
    and inference mode is off whatever the caller's mode -- under ``torch.no_grad()`` no parameter would get a
    gradient (a false "not equivalent"), under ``torch.inference_mode()`` nothing could be differentiated."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.inference_mode(False), torch.enable_grad():
            return fn(*args, **kwargs)

    return run


def default_tolerances(dtype: torch.dtype) -> dict[str, float]:
    """``{"logits": abs, "logprobs": abs, "grads": rel}`` used by :func:`verify` for ``dtype``."""
    if dtype not in _TOLERANCES:
        raise ValueError(f"no default tolerances for {dtype}: pass tol={{'logits':..., 'logprobs':..., 'grads':...}}")
    return dict(_TOLERANCES[dtype])



def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's output embedding (the config's text ``vocab_size`` when it has none)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(cfg.vocab_size)


def _stock_copy(model: torch.nn.Module, impl: str | None, dtype: torch.dtype, notes: list[str] | None = None
                ) -> tuple[torch.nn.Module, str]:
    """A deep copy of ``model`` (config included) on stock attention ``impl``, in ``dtype``, eval mode;
    running its own class forwards (see :func:`flexgroup.reference.oracle.own_copy`, whose notes go to ``notes``).
    Its parameters share the model's storage (no weights copied) unless ``dtype`` differs."""
    from .. import patches
    from ..reference.stock import stock_attention

    m, why = own_copy(model, share_parameters=True)  # copies the config too: never shares settings with the caller's
    if notes is not None:
        notes += [n for n in why if n not in notes]
    patches.unpatch(m)
    current = m.config._attn_implementation
    if impl is None:  # keep the model's own stock choice unless it cannot compute the config exactly
        impl = "eager" if stock_attention(m.config) == "eager" else (
            current if current in ("eager", "sdpa") else "sdpa")
    if current != impl:
        m.set_attn_implementation(impl)
    return m.to(dtype).eval(), impl


def _max_abs(x: torch.Tensor, y: torch.Tensor | None = None) -> float:
    """max |x - y| (max |x| without ``y``) in float64, ``_CHUNK`` entries at a time; NaN if any is NaN.
    Neither tensor is written: each chunk is copied before the in-place arithmetic (``.double()`` of a
    float64 tensor would be the tensor itself, and the gradients compared would be overwritten)."""
    xf, yf = x.reshape(-1), None if y is None else y.reshape(-1)
    best = 0.0
    for i in range(0, xf.numel(), _CHUNK):
        a = xf[i:i + _CHUNK].to(torch.float64, copy=True)
        if yf is not None:
            a = a.sub_(yf[i:i + _CHUNK].to(a.device, torch.float64))
        m = float(a.abs_().max())
        if math.isnan(m):
            return m
        best = max(best, m)
    return best


def _param_errors(grads: dict, ref: dict) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """``{name: (max|g - g_ref|, that / max|g_ref|)}`` over parameters with a gradient on either side
    (one side only: ``(inf, inf)``, named in the notes). One parameter and one chunk at a time."""
    out, notes = {}, []
    for name in list(grads) + [k for k in ref if k not in grads]:
        g, gb = grads.get(name), ref.get(name)
        if g is None and gb is None:
            continue
        if g is None or gb is None:
            notes.append(f"{name}: no gradient on the {'first' if g is None else 'reference'} side")
            out[name] = (math.inf, math.inf)
            continue
        d, den = _max_abs(g, gb), _max_abs(gb)
        out[name] = (d, d / den if den > 0 else (0.0 if d == 0 else math.inf))
    return out, notes


def grad_difference(model, reference) -> tuple[float, float, str, list[str]]:
    """Compare the gradients of same-named parameters of two models (or ``{name: grad}`` dicts).

    Returns ``(max_abs, max_rel, worst_parameter, notes)``: ``max_abs`` = max |g - g_ref| over all
    entries; ``max_rel`` = max over parameter tensors of ``max|g - g_ref| / max|g_ref|``;
    a parameter with a gradient on one side only counts as ``inf`` (named in ``notes``).
    """
    grads, ref = (_grads(m) if isinstance(m, torch.nn.Module) else m for m in (model, reference))
    errs, notes = _param_errors(grads, ref)
    if not errs:
        return 0.0, 0.0, "", notes
    worst = max(errs, key=lambda k: errs[k][1])
    abs_g = max((a for a, _ in errs.values() if math.isfinite(a)), default=0.0)
    return abs_g, errs[worst][1], worst, notes


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


def _advantages(n: int, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


def _backward(loss: torch.Tensor) -> None:
    if loss.requires_grad:  # else no parameter takes a gradient: the report says nothing was compared
        loss.backward()


def _check_limits(float64_bytes, tol) -> None:
    """ValueError, naming the value, for a byte limit that is not an int >= 0 or a tolerance that is not a finite
    number >= 0 of a known quantity (a nonsense limit would otherwise pick a calibration silently)."""
    if float64_bytes is not None and (isinstance(float64_bytes, bool) or not isinstance(float64_bytes, int)
                                      or float64_bytes < 0):
        raise ValueError(f"verify: float64_bytes={float64_bytes!r}: give the largest float64 copy in bytes, an int "
                         ">= 0 (e.g. 8 * 2**30), or None for no limit beyond the memory the process can allocate")
    for k, v in (tol or {}).items():
        if k not in ("logits", "logprobs", "grads"):
            raise ValueError(f"verify: tol has an unknown key {k!r}; the keys are 'logits', 'logprobs', 'grads'")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"verify: tol[{k!r}]={v!r}: a tolerance is a finite number >= 0")


@computes_gradients  # whatever the caller's grad mode: its own backward is the point
def verify(model: torch.nn.Module, batch, *, dtype: torch.dtype | None = None, backend: str = "auto",
           tol: dict[str, float] | None = None, baseline_attention: str | None = None,
           seed: int = 0, calibration: str = "auto",
           float64_bytes: int | None = None) -> VerifyReport:
    """Compare the grouped forward/backward of ``model`` on ``batch`` with the repeated-prefix baseline.

    Args:
        model: a transformers causal LM (patched or not; it is not modified: each side runs on its
            own deep copy, in eval mode so that dropout cannot differ; the copies share the model's
            weights, never writing them, and the grouped copy is freed before the baseline runs).
            A copy runs its class's ``forward`` where the model's was replaced by a closure over the
            original (TRL's fused LM head; named in the notes); RuntimeError if the caller's
            parameters or gradients changed all the same.
        batch: a :class:`flexgroup.GroupedBatch`; its token ids must be < the model's vocab size.
        dtype: cast the copies to this dtype (default: the model's parameter dtype).
        backend: flexgroup attention backend for the grouped copy (``flexgroup.patch(..., backend)``).
        tol: overrides of :func:`default_tolerances` (keys ``logits``, ``logprobs``, ``grads``).
        baseline_attention: stock implementation of the baseline copy; default ``sdpa``, ``eager``
            when the config softcaps attention logits (stock sdpa ignores softcapping).
        seed: seed of the advantages ``A [N]`` in the loss.
        calibration: ``"auto"``, ``"float64"``, ``"layerwise"``, ``"spread"`` or ``"none"`` (see the
            module docstring; default ``"auto"``). Not used for float64 runs.
        float64_bytes: the largest float64 copy ``"auto"`` makes (above it: layerwise, if that fits).
            Default: no limit beyond the memory the process can still allocate, measured.

    Returns:
        :class:`VerifyReport` with ``logits``, ``logprobs`` and ``grads`` differences. A quantity with
        nothing to compare (no parameter gradient on either side, no token read) fails: ``ok`` is False.
    """
    from ..patches import patch

    _check_limits(float64_bytes, tol)
    param = next(model.parameters())
    check_materialized(model, "verify")
    device = param.device
    dtype = dtype or param.dtype
    tols = default_tolerances(dtype) if dtype in _TOLERANCES else {}
    tols.update(tol or {})
    missing = {"logits", "logprobs", "grads"} - set(tols)
    if missing:
        raise ValueError(f"verify: no tolerance for {sorted(missing)} at {dtype}; pass tol=")
    calib, calib_note = _calibration(calibration, model, device, dtype, float64_bytes)
    vocab = vocab_size(model)
    if int(batch.input_ids.max()) >= vocab:
        raise ValueError(f"verify: the batch has token id {int(batch.input_ids.max())} but the model's vocabulary "
                         f"has {vocab} entries")

    n = batch.num_responses
    adv = _advantages(n, seed, torch.float64, device)
    mask = batch.response_mask.to(device)
    untouched = CallerState(model)
    copy_notes: list[str] = []

    # ---- grouped: one packed row through a patched copy (its graph freed before the baseline runs)
    with Peak() as grouped_peak:
        grouped, base_impl = _stock_copy(model, baseline_attention, dtype, copy_notes)
        patch(grouped, backend=backend)
        out = grouped(**batch.model_inputs(device)).logits  # [1, L, V]
        lp_g = batch.logprobs(out)  # [N, max_len]
        _backward(-(adv.to(lp_g.dtype)[:, None] * torch.where(mask, lp_g, 0)).sum() / n)
        logits_g, lp_g = out.detach()[0], lp_g.detach()
        grads_g = _grads(grouped)
        del grouped, out

    # ---- baseline: each [P; R_i] alone through a never-patched copy (and the float64 truth), longest first:
    # its measured peak bounds the others' and sizes the "auto" calibration
    base, _ = _stock_copy(model, base_impl, dtype, copy_notes)
    ref = None
    ids = batch.input_ids
    lp_b = torch.zeros_like(lp_g)
    lp_r = torch.zeros(lp_g.shape, dtype=torch.float64, device=device)
    d_logits = rel_logits_den = e_logits_g = e_logits_s = 0.0
    worst_logits = ""
    order = sorted(range(n), key=lambda i: -batch.paths[i].numel())
    for k, i in enumerate(order):  # output row i: its whole sequence in the packed row
        seq = ids[batch.paths[i]].to(device)  # [S]
        r = batch.response_lengths[i]
        p = seq.numel() - r
        read = mask[i, :r]
        extra = batch.sequence_inputs(i, device) if hasattr(batch, "sequence_inputs") else {}  # VL: its images
        with Peak() as base_peak:
            logits_b, lp = _path_run(base, seq, r, read, -adv[i] / n, extra)
        if k == 0:
            if calib == "auto":
                calib, calib_note = choose_by_memory(model, dtype, _activations(grouped_peak, grads_g, base_peak,
                                                                                _grads(base)), float64_bytes)
            if calib in ("float64", "layerwise"):
                ref = Float64Reference(calib, base, lambda: _stock_copy(model, base_impl, torch.float64, copy_notes)[0])
        lp_b[i, :r] = lp.to(lp_b.dtype)
        mine = logits_g[batch.paths[i].to(device)]
        diff = _row_max_abs_diff(mine, logits_b)  # [S]
        if float(diff.max()) > d_logits:
            d_logits = float(diff.max())
            t = int(diff.argmax())
            worst_logits = f"sequence {i}, {'prompt' if t < p else 'response'} position {t}"
        rel_logits_den = max(rel_logits_den, float(logits_b.abs().max()))
        if ref is not None:
            logits_r, lp_r[i, :r] = ref.run(seq, r, read, -adv[i] / n, extra)
            e_logits_g = max(e_logits_g, float(_row_max_abs_diff(mine, logits_r).max()))
            e_logits_s = max(e_logits_s, float(_row_max_abs_diff(logits_b, logits_r).max()))
        del logits_b
    if ref is not None:
        ref.release()  # the float64 copy's weights go; its gradients (float32 sums) stay
    if calib == "auto":  # no sequence ran (nothing to calibrate)
        calib = "none"

    def masked_max(x: torch.Tensor) -> float:
        return float(torch.where(mask, x.abs(), 0).max())

    dl = torch.where(mask, (lp_g.double() - lp_b.double()).abs(), 0)
    flat = int(dl.argmax())
    d_lp = float(dl.max())
    rel_lp = d_lp / max(masked_max(lp_b.double()), 1e-30)
    errs, notes = _param_errors(grads_g, _grads(base))
    notes = copy_notes + notes
    worst_name = max(errs, key=lambda k: errs[k][1]) if errs else ""
    abs_g = max((a for a, _ in errs.values() if math.isfinite(a)), default=0.0)

    diffs = [
        Difference("logits", d_logits, d_logits / max(rel_logits_den, 1e-30), tols["logits"], "abs", worst_logits),
        Difference("logprobs", d_lp, rel_lp, tols["logprobs"], "abs",
                   f"response {flat // dl.shape[1]}, token {flat % dl.shape[1]}"),
        Difference("grads", abs_g, errs[worst_name][1] if errs else 0.0, tols["grads"], "rel", worst_name),
    ]
    if ref is not None and not e_logits_s <= _IMPLAUSIBLE * torch.finfo(dtype).eps * rel_logits_den:  # no truth
        notes.append(f"calibration {calib} dropped: its float64 run differs from the stock run by {e_logits_s:.2e} "
                     f"in logits, over {_IMPLAUSIBLE:g} x {dtype}'s eps x max |logits|: fixed tolerances only "
                     "(please report it)")
        calib, ref = "none", None
    if ref is not None:
        _calibrate(diffs, (e_logits_g, e_logits_s), (masked_max(lp_g.double() - lp_r), masked_max(lp_b.double() - lp_r)),
                   errs, _param_errors(grads_g, ref.grads())[0], _param_errors(_grads(base), ref.grads())[0])
    elif calib == "spread":
        del grads_g  # the spread's own gradients take their place (the errors above are kept)
        try:
            s_logits, s_lp, s_grads, orders = stock_spread(base, base_impl, batch, mask, adv, n, lp_b, _param_errors)
        except Exception as e:  # noqa: BLE001 -- a model the other orders cannot run: say so, fixed tolerances
            calib = "none"
            calib_note = (f"calibration spread skipped: running the stock model another way failed on this model "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); fixed tolerances only")
        else:
            _calibrate(diffs, (d_logits, s_logits), (d_lp, s_lp), errs, errs, s_grads)
            calib_note = "; ".join(x for x in (calib_note, "spread: each alone against " + " and ".join(orders)) if x)
    if calib_note:
        notes.append(calib_note)
    # a quantity with nothing to compare is no evidence: it fails, saying so
    if not bool(mask.any()):
        _nothing_compared(diffs[1], notes, "no log-prob was compared (the batch reads no token)")
    if not errs:
        _nothing_compared(diffs[2], notes, "no parameter gradient was compared (no parameter has a gradient on "
                                           "either side: are they all frozen?)")
    untouched.check()
    cost = batch.cost()
    return VerifyReport(diffs, getattr(model.config, "model_type", type(model).__name__), dtype,
                        backend, base_impl, n, cost.grouped_tokens, cost.baseline_tokens, notes,
                        {"float64": "float64", "layerwise": "float64", "spread": "stock spread"}.get(calib), calib)


def _activations(grouped: Peak, grouped_grads: dict, base: Peak, base_grads: dict) -> int | None:
    """Measured activations and temporaries of one run: the larger peak of the grouped run and of the
    longest sequence's baseline run, each less the gradients it left; None where peaks cannot be measured."""
    if grouped.above_start is None or base.above_start is None:
        return None

    def kept(grads: dict) -> int:
        return sum(g.numel() * g.element_size() for g in grads.values() if g is not None)
    return max(grouped.above_start - kept(grouped_grads), base.above_start - kept(base_grads), 0)


def _row_max_abs_diff(a: torch.Tensor, b: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """max |a - b| per row, in float64, [S] from [S, V] (a few rows at a time: no [S, V] float64 copies)."""
    return torch.cat([(a[i:i + rows].double() - b[i:i + rows].double()).abs().amax(dim=1)
                      for i in range(0, a.shape[0], rows)])
