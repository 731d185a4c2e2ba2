"""Trainer integrations (optional dependencies, imported on demand).

- :mod:`flexgroup.integrations.trl`: TRL's ``GRPOTrainer`` with shared-prefix forwards
  (``pip install 'flexgroup[trl]'``).

Nothing here is imported by ``import flexgroup``; import the submodule you need.
"""

__all__ = ["trl"]
