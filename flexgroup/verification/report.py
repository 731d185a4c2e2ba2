"""verify's report: each compared quantity (:class:`Difference`) and the verdict (:class:`VerifyReport`).

:func:`calibrate` applies the calibrated rule: a quantity passes within its fixed tolerance of the
stock run, or when flexgroup's error against the float64 truth is at most ``FACTOR`` x the stock
run's own (gradients: per parameter tensor). :mod:`flexgroup.verification.equivalence` fills these in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["Difference", "VerifyReport", "FACTOR", "calibrate", "nothing_compared"]

FACTOR = 4.0  # calibrated pass: flexgroup's error vs the float64 truth <= FACTOR x the stock run's own error

@dataclass
class Difference:
    """One compared quantity: ``max_abs`` = max |grouped - baseline|; ``max_rel`` = ``max_abs``
    over the baseline's max |value| (for gradients: per parameter tensor, then the max over
    tensors); ``tol`` applies to ``max_abs`` (``kind="abs"``) or ``max_rel`` (``kind="rel"``).

    With a float64 reference: ``flex_error`` / ``stock_error`` are the grouped run's and the stock
    run's errors against it (same measure as ``kind``; gradients: max over parameter tensors), and
    ``calibrated`` says whether flexgroup's error is within ``factor`` of the stock run's own
    (gradients: every parameter tensor within tolerance or within the factor). ``ok`` is
    ``within_tol or calibrated``."""

    name: str
    max_abs: float
    max_rel: float
    tol: float
    kind: str
    where: str = ""
    flex_error: float | None = None
    stock_error: float | None = None
    calibrated: bool | None = None
    factor: float = FACTOR

    @property
    def within_tol(self) -> bool:
        value = self.max_abs if self.kind == "abs" else self.max_rel
        return math.isfinite(value) and value <= self.tol

    @property
    def ok(self) -> bool:
        return self.within_tol or bool(self.calibrated)

    @property
    def resolution(self) -> float:
        """Resolving power: the largest difference this verdict lets pass (``kind`` units), the smallest leak verify
        can detect: ``tol``, or ``max(tol, factor x stock_error)`` when calibrated (the stock run's own error here)."""
        return max(self.tol, self.factor * s) if math.isfinite(s := self.stock_error or 0.0) else self.tol


@dataclass
class VerifyReport:
    """Result of :func:`verify`. ``ok`` is True when every quantity is within tolerance (or calibrated)."""

    differences: list[Difference]
    model_type: str
    dtype: torch.dtype
    backend: str
    baseline_attention: str
    num_responses: int
    grouped_tokens: int
    baseline_tokens: int
    notes: list[str] = field(default_factory=list)
    reference: str | None = None  # "float64" (also layerwise), "stock spread" (the spread calibration) or None
    calibration: str = "none"  # what the verdict was calibrated on: "float64", "layerwise", "spread" or "none"

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.differences)

    def __getitem__(self, name: str) -> Difference:
        for d in self.differences:
            if d.name == name:
                return d
        raise KeyError(f"no quantity {name!r}; have {[d.name for d in self.differences]}")

    def table(self) -> str:
        """A printable table of the differences, with a header describing the run."""
        dt = str(self.dtype).replace("torch.", "")
        lines = [
            f"flexgroup verify: {self.model_type}, {dt}, grouped backend {self.backend!r}; baseline: each "
            f"[P; R_i] alone through the unpatched model ({self.baseline_attention})",
            f"{self.num_responses} responses: {self.grouped_tokens} tokens packed vs "
            f"{self.baseline_tokens} one by one",
            "",
        ]
        ref = self.reference is not None
        spread = self.calibration == "spread"
        head = f"{'quantity':<12} {'max |diff|':>11} {'max rel':>10} {'tolerance':>14}"
        if ref:
            head += (f"  {'vs alone:':>11} {'flexgroup':>9} {'stock':>9}" if spread else
                     f"  {'vs ' + self.reference + ':':>11} {'flexgroup':>9} {'stock':>9}")
        lines.append(head + "  ok   worst at")
        for d in self.differences:
            row = f"{d.name:<12} {d.max_abs:>11.3e} {d.max_rel:>10.3e} {d.kind + f' {d.tol:.0e}':>14}"
            if ref:
                row += f"  {'':>11} {_fmt(d.flex_error):>9} {_fmt(d.stock_error):>9}"
            lines.append(row + f"  {'yes' if d.ok else 'NO ':<4} {d.where}")
        if ref and spread:
            f = self.differences[0].factor
            lines.append(f"(vs alone: distance from each sequence run alone through the stock model; no float64 copy, so "
                         f"the noise floor is the stock model's own spread -- the same sequences run other ways (see "
                         f"the note) against each alone; a quantity passes within its tolerance, or when flexgroup's "
                         f"distance is at most {f:g}x the stock spread -- for gradients, per parameter tensor)")
        elif ref:
            f = self.differences[0].factor
            lines.append(f"(vs {self.reference}: error against a {self.reference} run of the stock model, the truth; a "
                         f"quantity passes within its tolerance of the stock run,\n or when flexgroup's error is at most "
                         f"{f:g}x the stock {dt} run's own -- for gradients, per parameter tensor)")
        lines += [f"note: {n}" for n in self.notes]
        r = {d.name: d.resolution for d in self.differences}
        if {"logprobs", "logits", "grads"} <= r.keys():
            f = self.differences[0].factor
            lines.append(f"resolving power: at {dt} differences below {r['logprobs']:.2e} in log-probs, {r['logits']:.2e} "
                         f"in logits, {r['grads']:.2e} relative in gradients pass (the tolerance, or {f:g}x the stock "
                         f"run's own error): a smaller leak cannot be told from {dt} rounding")
        lines.append(f"calibration: {self.calibration}")
        lines.append(f"equivalent: {'yes' if self.ok else 'no'}")
        return "\n".join(lines)

    __str__ = table


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"



def nothing_compared(d: Difference, notes: list[str], why: str) -> None:
    d.max_abs = d.max_rel = math.inf
    d.calibrated = False
    d.where = "nothing compared"
    notes.append(f"{why}: verify cannot call the run equivalent")


def calibrate(diffs: list[Difference], logits: tuple[float, float], logprobs: tuple[float, float],
               direct: dict, flex: dict, stock: dict) -> None:
    """Fill the float64-reference fields of ``diffs`` (logits, logprobs, grads), in place.

    ``logits``/``logprobs``: (flexgroup's, the stock run's) max abs error against the reference.
    ``direct``/``flex``/``stock``: per-parameter ``(abs, rel)`` gradient errors -- grouped vs stock,
    grouped vs reference, stock vs reference.
    """
    for d, (fe, se) in zip(diffs[:2], (logits, logprobs)):
        d.flex_error, d.stock_error = fe, se
        d.calibrated = math.isfinite(fe) and math.isfinite(se) and fe <= d.factor * se  # an infinite floor: none
    g = diffs[2]
    g.flex_error = max((v[1] for v in flex.values()), default=0.0)
    g.stock_error = max((v[1] for v in stock.values()), default=0.0)
    bad = [k for k in direct if not direct[k][1] <= g.tol
           and not (math.isfinite(flex[k][1]) and math.isfinite(stock[k][1]) and flex[k][1] <= g.factor * stock[k][1])]
    g.calibrated = not bad
    if bad and g.where not in bad:
        g.where = bad[0]
