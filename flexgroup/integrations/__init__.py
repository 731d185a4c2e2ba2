"""Trainer integrations (optional dependencies, imported on demand).

- :mod:`flexgroup.integrations.trl`: TRL's ``GRPOTrainer`` with shared-prefix forwards
  (``pip install -e ".[trl]"``).
- :mod:`flexgroup.integrations.trl_stream`: that adapter's per-forward token budget (chunks of rows
  too large for one forward are streamed); used through ``FlexGroupGRPOTrainer(flexgroup_budget=)``.
- :mod:`flexgroup.integrations.trl_dpo`: TRL's ``DPOTrainer`` with each (prompt, chosen, rejected) as
  one group (``pip install -e ".[trl]"``).
- :mod:`flexgroup.integrations.lm_eval`: the lm-evaluation-harness model ``flexgroup``
  (``pip install -e ".[eval]"``).
- :mod:`flexgroup.integrations.verl`: verl 0.9's FSDP actor engine with grouped forwards, enabled by
  ``actor_rollout_ref.model.external_lib=flexgroup.integrations.verl`` (``pip install -e ".[verl]"``).

Nothing here is imported by ``import flexgroup``; import the submodule you need.
"""

__all__ = ["trl", "trl_dpo", "lm_eval", "verl", "mix_into"]

_MIXED: dict[tuple[type, type], type] = {}


def mix_into(obj, mixin: type) -> None:
    """Give ``obj`` the behaviour of ``mixin`` in place: its class becomes ``FlexGroup<Class>``, a
    subclass of ``(mixin, type(obj))`` built once per class. A no-op when it already has ``mixin``."""
    cls = type(obj)
    if not issubclass(cls, mixin):
        if (mixin, cls) not in _MIXED:
            _MIXED[mixin, cls] = type(f"FlexGroup{cls.__name__}", (mixin, cls), {"__module__": mixin.__module__})
        obj.__class__ = _MIXED[mixin, cls]
