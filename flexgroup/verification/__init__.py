"""Layer 4, verification: ``flexgroup.verify`` and its noise floor.

- :mod:`~flexgroup.verification.equivalence` -- ``verify``: grouped vs each sequence alone, any model
  (``flexgroup.verify``);
- :mod:`~flexgroup.verification.calibration` -- the noise floor: float64 truth;
- :mod:`~flexgroup.verification.report` -- :class:`Difference`, :class:`VerifyReport`, the calibrated rule;
- :mod:`~flexgroup.verification.invariance` -- ``check_batch_invariance``: a tree alone vs packed with others, bitwise;
- :mod:`~flexgroup.verification.memory` -- what the process may still allocate (``headroom``); a phase's measured
  peak (:class:`Peak`).

Each name loads its module on first use (``import flexgroup.verification`` imports neither torch nor transformers).
"""

from ..submodules import loader as _loader

_EXPORTS = {
    "verify": "equivalence", "grad_difference": "equivalence", "default_tolerances": "equivalence",
    "VerifyReport": "report", "Difference": "report",
    "check_batch_invariance": "invariance", "InvarianceReport": "invariance",
    "headroom": "memory", "Peak": "memory",
}
__all__ = list(_EXPORTS)

__getattr__ = _loader(__name__, _EXPORTS)  # a public name, or a submodule (flexgroup.verification.<module>)
