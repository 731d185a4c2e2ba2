"""Layer 4, losses and scoring.

- :mod:`~flexgroup.train.grpo` -- GRPO-style losses over grouped log-probs;
- :mod:`~flexgroup.train.scoring` -- ``flexgroup.score`` (:class:`Scores`);
- :mod:`~flexgroup.train.evaluation` -- multiple-choice evaluation on top of scoring.
"""

from ..submodules import loader as _loader

__getattr__ = _loader(__name__)  # a submodule (flexgroup.train.<module>) loads on first use
