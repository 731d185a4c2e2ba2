"""Layer 4, losses and scoring.

- :mod:`~flexgroup.train.grpo` -- GRPO-style losses over grouped log-probs;
- :mod:`~flexgroup.train.scoring` -- ``flexgroup.score`` (:class:`Scores`);
- :mod:`~flexgroup.train.evaluation` -- multiple-choice evaluation on top of scoring.
"""


def __getattr__(name):  # a submodule loads on first use: ``flexgroup.train.<module>`` works after ``import flexgroup``
    import importlib

    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
