"""Layer 4, losses and scoring.

- :mod:`~flexgroup.train.grpo` -- GRPO-style losses over grouped log-probs (``group_advantages``,
  ``policy_loss``, ``kl_k3``);
- :mod:`~flexgroup.train.scoring` -- ``flexgroup.score`` (:class:`Scores`), ``score_sequences``;
- :mod:`~flexgroup.train.evaluation` -- multiple-choice evaluation on top of scoring (``loglikelihood``,
  ``multiple_choice``).

Each name loads its module on first use.
"""

from ..submodules import loader as _loader

_EXPORTS = {
    "group_advantages": "grpo", "policy_loss": "grpo", "kl_k3": "grpo",
    "score": "scoring", "Scores": "scoring", "score_sequences": "scoring",
    "loglikelihood": "evaluation", "multiple_choice": "evaluation",
}
__all__ = list(_EXPORTS)

__getattr__ = _loader(__name__, _EXPORTS)  # a public name, or a submodule (flexgroup.train.<module>), on first use
