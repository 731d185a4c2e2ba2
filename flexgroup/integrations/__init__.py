"""Trainer integrations (optional dependencies, imported on demand).

- :mod:`flexgroup.integrations.trl`: TRL's ``GRPOTrainer`` with shared-prefix forwards
  (``pip install 'flexgroup[trl]'``).
- :mod:`flexgroup.integrations.trl_dpo`: TRL's ``DPOTrainer`` with each (prompt, chosen, rejected) as
  one group (``pip install 'flexgroup[trl]'``).
- :mod:`flexgroup.integrations.lm_eval`: the lm-evaluation-harness model ``flexgroup``
  (``pip install 'flexgroup[eval]'``).

Nothing here is imported by ``import flexgroup``; import the submodule you need.
"""

__all__ = ["trl", "trl_dpo", "lm_eval"]
