"""What a kernel backend is: the capabilities it declares, a Plan built once per forward, a run per layer.

A backend turns ``(layout, pattern, score_mod, device)`` into a :class:`Plan` -- every tensor and
closure that does not depend on the layer (block masks, gather indices, per-token tables, the
score_mod on physical indices) -- and then runs ``q, k, v`` of each layer against that plan. A new
backend subclasses :class:`Backend`, states what it supports, and is added to
``flexgroup.kernels.BACKENDS``; dispatch reads the declarations, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..layout import Layout
from ..layout.patterns import Pattern
from ..layout.score_mods import ScoreMod

__all__ = ["Backend", "Plan"]


@dataclass
class Plan:
    """The per-forward, layer-independent work of one backend for one (layout, pattern, score_mod, device).

    Attributes:
        backend: the backend's name.
        layout: the packed row's layout (``L = layout.num_tokens``).
        pattern, score_mod: normalised (a :class:`Pattern` / :class:`ScoreMod`, or None).
        device: where the plan's tensors live.
        data: backend-specific contents (see each backend).
    """

    backend: str
    layout: Layout
    pattern: Pattern | None
    score_mod: ScoreMod | None
    device: torch.device
    data: Any = field(repr=False, default=None)


class Backend:
    """Base class. Subclasses set the declarations and implement :meth:`prepare` and :meth:`run`.

    Declarations:
        name: the registry key (``backend="..."``).
        devices: device types it runs on (None: any).
        backward_devices: device types where it is differentiable (None: wherever it runs).
        exact_note: one line on how it computes, shown in errors and docs.
    """

    name: str = "?"
    devices: tuple[str, ...] | None = None
    backward_devices: tuple[str, ...] | None = None
    exact_note: str = ""

    def refusal(self, device_type: str, needs_grad: bool) -> str | None:
        """Why this backend cannot run here (a message naming the fix), or None if it can."""
        if self.devices is not None and device_type not in self.devices:
            return (f"backend={self.name!r} does not run on {device_type}: it runs on {', '.join(self.devices)}; "
                    "use backend='sdpa' (exact on any device) or 'auto'")
        grad_ok = self.backward_devices if self.backward_devices is not None else self.devices
        if needs_grad and grad_ok is not None and device_type not in grad_ok:
            return (f"backend={self.name!r} cannot train on {device_type.upper()}: it has no backward pass there. "
                    "Use backend='sdpa' (exact, differentiable) or 'auto', or run under torch.no_grad()")
        return None

    def settings(self) -> tuple:
        """The module-level tuning a plan depends on besides its arguments (part of the plan cache's key)."""
        return ()

    def prepare(self, layout: Layout, pattern: Pattern | None, score_mod: ScoreMod | None,
                device: torch.device, **options) -> Plan:  # pragma: no cover - abstract
        raise NotImplementedError

    def run(self, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scale: float) -> torch.Tensor:  # pragma: no cover - abstract
        """q [1, Hq, L, D], k/v [1, Hkv, L, D] -> [1, Hq, L, D]."""
        raise NotImplementedError
