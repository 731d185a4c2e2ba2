"""Trainer integrations (optional dependencies, imported on demand).

- :mod:`flexgroup.integrations.trl`: TRL's ``GRPOTrainer`` with shared-prefix forwards
  (``pip install -e ".[trl]"``).
- :mod:`flexgroup.integrations.trl_stream`: that adapter's per-forward token budget (chunks of rows
  too large for one forward are streamed); used through ``FlexGroupGRPOTrainer(flexgroup_budget=)``.
- :mod:`flexgroup.integrations.trl_vision`: that adapter on Qwen2-VL, Qwen2.5-VL and Qwen3-VL (images through
  ``MultimodalGroupedBatch``); used by ``FlexGroupGRPOTrainer`` on such a model.
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

# optional dependency (top-level module) -> the extra of pyproject.toml that installs it
EXTRAS = {"trl": "trl", "datasets": "trl", "peft": "peft", "lm_eval": "eval", "verl": "verl", "gguf": "real",
          "matplotlib": "plot"}


def install_hint(error: ImportError) -> str | None:
    """One line naming the missing optional dependency and its install command, or None when ``error`` (or
    the error it was raised from) is not about a module of :data:`EXTRAS`."""
    missing = error if isinstance(error, ModuleNotFoundError) else error.__cause__
    top = (getattr(missing, "name", None) or "").split(".")[0]
    if top not in EXTRAS:
        return None
    return (f'needs {top}, which is not installed: pip install -e ".[{EXTRAS[top]}]" (in the flexgroup clone; '
            "flexgroup is not on a package index)")

from ..submodules import loader as _loader

__getattr__ = _loader(__name__)  # a submodule (flexgroup.integrations.<module>) loads on first use
