"""The kernel wrappers that fork a hybrid mixer's state inside a grouped mixer call.

A Gated DeltaNet or Mamba2 mixer computes its state with a causal depthwise conv and a chunked scan,
module-level functions of its modeling module (:data:`FUNCTIONS`). :mod:`flexgroup.patches.hybrid.spec`
replaces them there with the pass-through wrappers below (:data:`WRAPPERS`): outside a grouped mixer
call they call the original; inside one (:data:`ACTIVE` holds its :class:`Fork`) they split the packed
row by depth, call the original with initial states (:mod:`flexgroup.kernels.fork`) and record that
they ran (:meth:`Fork.hit`), so a mixer that bypassed them is caught (:class:`BypassedFork`).
"""

from __future__ import annotations

import contextvars
import sys
from dataclasses import dataclass

import torch

from flexgroup.data.carrier import GroupedMask
from flexgroup.kernels.fork import ForkPlan, ForkStates, fork_plan, forked_conv, forked_gated_delta, forked_mamba2_scan

__all__ = ["GDN", "MAMBA2", "FUNCTIONS", "WRAPPERS", "ACTIVE", "Fork", "BypassedFork", "active_mask",
           "module_level", "holds_kernels", "wrap_conv", "wrap_gated_delta", "wrap_mamba2_scan", "wrap_unfused"]

# mixer kind -> the module-level functions of the mixer's modeling module that flexgroup wraps: the conv and
# the scan (forked), and Mamba2's fused training shortcut (answers None inside a grouped call)
GDN = "gated_deltanet"
MAMBA2 = "mamba2"
FUNCTIONS = {
    GDN: ("causal_conv1d_fn", "torch_chunk_gated_delta_rule"),
    MAMBA2: ("causal_conv1d_fn", "mamba2_chunk_scan", "mamba2_split_conv1d_scan_combined"),
}

ACTIVE: contextvars.ContextVar = contextvars.ContextVar("flexgroup_hybrid_fork", default=None)

def active_mask() -> GroupedMask | None:
    """The carrier of the grouped stateful-mixer call in progress (None outside one)."""
    fork = ACTIVE.get()
    return None if fork is None else fork.mask


@dataclass
class Fork:
    """The state fork of one grouped mixer call (``mask``: its carrier; ``where``: the mixer, for errors).

    A streamed chunk's fork starts its roots from states kept by earlier chunks: the subclass
    :class:`flexgroup.stream.hybrid_fork.StreamFork`, which the chunk makes (``ChunkContext.mixer_fork``)."""

    mask: GroupedMask
    where: str

    def plan(self, conv_kernel: int, x: torch.Tensor, dim: int) -> ForkPlan:
        """The plan on ``x``'s device (built once per forward, kept in the carrier), after checking that
        ``x`` is one packed row along ``dim``."""
        layout = self.mask.grouped_layout
        if x.shape[0] != 1 or x.shape[dim] != layout.num_tokens:
            raise RuntimeError(f"{self.where}: a grouped stateful mixer got a tensor of shape {tuple(x.shape)}, not "
                               f"one packed row of {layout.num_tokens} tokens (dim {dim}); please report it")
        return self.mask.plan(("fork", conv_kernel, str(x.device)),
                              lambda: fork_plan(layout, conv_kernel).to(x.device))

    def hit(self, kernel: str) -> None:
        """Record that the forked ``kernel`` (``"conv"`` or ``"scan"``) ran in this mixer call."""
        self.__dict__.setdefault("hits", set()).add(kernel)

    def conv_input(self, x: torch.Tensor, plan: ForkPlan) -> torch.Tensor:
        """``x`` [L + 1, C] as the conv levels gather it (a streamed chunk appends its kept context rows)."""
        return x

    def states(self) -> ForkStates:
        """The carrier of final states between depths (a streamed chunk starts roots from kept states)."""
        return ForkStates()

    def check(self, kwargs: dict, names=("cu_seqlens", "seq_idx", "initial_state", "initial_states")):
        for k in names:
            if kwargs.get(k) is not None:
                raise RuntimeError(f"{self.where}: {k!r} given to a grouped stateful mixer; flexgroup forks the "
                                   "state itself and cannot combine it with another packing: remove it")


def wrap_conv(original):
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        """Grouped: ``hidden_states`` [1, C, L] -> [1, C, L] (:func:`flexgroup.kernels.fork.forked_conv`)."""
        fork = ACTIVE.get()
        if fork is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        fork.check(kwargs)
        fork.hit("conv")
        plan = fork.plan(weight.shape[-1], hidden_states, -1)
        return forked_conv(original, plan, hidden_states, weight, bias, activation=activation,
                           conv_input=fork.conv_input, **kwargs)

    return causal_conv1d_fn


def wrap_gated_delta(original):
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, *args, **kwargs):
        """Grouped: q/k [1, L, Hk, K], v [1, L, Hv, V], g/beta [1, L, Hv] -> ([1, L, Hv, V], None)."""
        fork = ACTIVE.get()
        if fork is None:
            return original(query, key, value, g, beta, *args, **kwargs)
        if args or kwargs.get("output_final_state"):
            raise RuntimeError(f"{fork.where}: unexpected call of the gated delta rule (positional options or "
                               "output_final_state) in a grouped forward; please report it")
        fork.check(kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("initial_state", "output_final_state", "cu_seqlens")}
        fork.hit("scan")
        return forked_gated_delta(original, fork.plan(1, query, 1), query, key, value, g, beta, states=fork.states(),
                                  **kwargs), None

    return torch_chunk_gated_delta_rule


def wrap_mamba2_scan(original):
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                          dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        """Grouped: x [1, L, H, P], dt [1, L, H], B/C [1, L, G, N] -> y [1, L, H, P]."""
        fork = ACTIVE.get()
        if fork is None:
            return original(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                            initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                            return_final_states=return_final_states, **kwargs)
        if initial_states is not None or return_final_states:
            raise RuntimeError(f"{fork.where}: unexpected states in a grouped Mamba2 scan; please report it")
        fork.check(kwargs)
        fork.hit("scan")
        return forked_mamba2_scan(original, fork.plan(1, hidden_states, 1), hidden_states, dt, A, B, C, chunk_size,
                                  states=fork.states(),
                                  D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, **kwargs)

    return mamba2_chunk_scan


def wrap_unfused(original):
    def mamba2_split_conv1d_scan_combined(*args, **kwargs):
        """Inside a grouped forward: ``None`` (the stock mixer then runs conv and scan separately)."""
        return None if ACTIVE.get() is not None else original(*args, **kwargs)

    return mamba2_split_conv1d_scan_combined


WRAPPERS = {"causal_conv1d_fn": wrap_conv, "torch_chunk_gated_delta_rule": wrap_gated_delta,
             "mamba2_chunk_scan": wrap_mamba2_scan, "mamba2_split_conv1d_scan_combined": wrap_unfused}


def module_level(m: torch.nn.Module, kind: str) -> list[str]:
    """The functions of ``FUNCTIONS[kind]`` that ``m``'s modeling module defines (callables; transformers
    5.25 makes each a ``kernels`` function module), whether or not ``forward`` names them itself."""
    module = sys.modules[type(m).__module__]
    return [n for n in FUNCTIONS[kind] if callable(getattr(module, n, None))]


def holds_kernels(m: torch.nn.Module, kind: str) -> bool:
    """Whether ``m``'s modeling module lacks the conv or the scan function: its kernels are then instance
    attributes (transformers 5.10, :mod:`flexgroup.patches.hybrid.attrs`) or flexgroup cannot fork it."""
    names = module_level(m, kind)
    return not (any("conv" in n for n in names) and any("scan" in n or "rule" in n for n in names))


class BypassedFork(RuntimeError):
    """A grouped mixer call whose stock forward did not run every forked kernel (``ran``: those it did run)."""

    def __init__(self, message: str, ran: set):
        super().__init__(message)
        self.ran = ran
