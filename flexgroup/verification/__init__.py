"""Layer 4, verification: ``flexgroup.verify`` and its noise floor.

- :mod:`~flexgroup.verification.verify` -- grouped vs each sequence alone, any model (``flexgroup.verify``);
- :mod:`~flexgroup.verification.calibration` -- the noise floor: float64 truth;
- :mod:`~flexgroup.verification.report` -- ``Difference``, ``VerifyReport``, the calibrated rule;
- :mod:`~flexgroup.verification.invariance` -- ``check_batch_invariance``: a tree alone vs packed with others, bitwise;
- :mod:`~flexgroup.verification.memory` -- what the process may still allocate; a phase's measured peak.
"""

from ..submodules import loader as _loader

__getattr__ = _loader(__name__)  # a submodule (flexgroup.verification.<module>) loads on first use
