"""Layer 4, verification: ``flexgroup.verify`` and its noise floor.

- :mod:`~flexgroup.verification.verify` -- grouped vs each sequence alone, any model (``flexgroup.verify``);
- :mod:`~flexgroup.verification.calibration` -- the noise floor: float64 truth;
- :mod:`~flexgroup.verification.report` -- ``Difference``, ``VerifyReport``, the calibrated rule;
- :mod:`~flexgroup.verification.memory` -- what the process may still allocate; a phase's measured peak.
"""


def __getattr__(name):  # a submodule loads on first use: ``flexgroup.verification.<module>`` works after ``import flexgroup``
    import importlib

    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
