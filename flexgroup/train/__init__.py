"""Layer 4, losses and scoring.

- :mod:`~flexgroup.train.grpo` -- GRPO-style losses over grouped log-probs;
- :mod:`~flexgroup.train.scoring` -- ``flexgroup.score`` (:class:`Scores`);
- :mod:`~flexgroup.train.evaluation` -- multiple-choice evaluation on top of scoring.
"""

from .._moved import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # a submodule loads on first use
