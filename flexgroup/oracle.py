"""The repeated baseline, one definition: each sequence run alone through a stock (unpatched) model.

Shared by ``flexgroup.verify``, the generic path's self-check, the CLI and the benchmarks. It calls
the model exactly as a user would for one sequence (``input_ids [1, S]``, no mask, no cache), so it
knows nothing of flexgroup's layouts: the grouped result is compared with this, never with itself.

No transformers import here (the model is whatever the caller passes).
"""

from __future__ import annotations

import copy
import functools
import types

import torch

__all__ = ["logits_alone", "logprobs_alone", "logprobs_of", "own_copy"]


def _reaches(obj, targets: set[int], depth: int = 4) -> bool:
    """Whether ``obj`` (a function, bound method or partial) holds one of the objects whose ids are in
    ``targets``: as a bound ``self``, a closure cell, a global it reads, or a partial's argument (a few
    levels deep)."""
    if id(obj) in targets:
        return True
    if depth == 0:
        return False
    if isinstance(obj, types.MethodType):
        inner = [obj.__self__, obj.__func__]
    elif isinstance(obj, functools.partial):
        inner = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, types.FunctionType):
        inner = [c.cell_contents for c in (obj.__closure__ or ()) if _filled(c)]
        # bound methods, partials and modules it reads from its module's globals (a script's ``orig = model.forward``)
        inner += [v for v in (obj.__globals__.get(n) for n in obj.__code__.co_names)
                  if isinstance(v, (types.MethodType, functools.partial, torch.nn.Module))]
    else:
        return False
    return any(_reaches(x, targets, depth - 1) for x in inner)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def own_copy(model: torch.nn.Module, share_parameters: bool = False) -> tuple[torch.nn.Module, list[str]]:
    """``copy.deepcopy(model)`` that runs only its own modules; returns ``(copy, notes)``.

    ``share_parameters``: the copy's parameters are new ``nn.Parameter`` objects over the *same*
    storage as the model's (their own ``.grad``, the same version counter), so the copy costs no
    weights; an in-place write to them would show in the model's version counters
    (:class:`CallerState` catches it). A later ``.to(other_dtype)`` of the copy allocates its own.
    Parameter subclasses (quantised weights) are copied as before.

    A module whose ``forward`` was replaced on the instance by a closure over the *original* (TRL's fused
    LM head: ``model.forward = MethodType(fused, model)`` closing over the original bound ``forward``)
    would, deep-copied, still call the original model: the copy's instance-level ``forward`` is removed
    so that its class's ``forward`` runs. ``notes`` name each module so changed.
    """
    originals = {id(m) for m in model.modules()}
    memo = {id(p): torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad)
            for p in model.parameters() if type(p) is torch.nn.Parameter} if share_parameters else {}
    twin = copy.deepcopy(model, memo)
    notes = []
    for name, m in twin.named_modules():
        fwd = m.__dict__.get("forward")
        if fwd is not None and _reaches(fwd, originals):
            del m.__dict__["forward"]
            notes.append(f"{name or type(m).__name__}.forward was replaced on the instance by a function of the "
                         f"original model (e.g. TRL's fused LM head): the copies run {type(m).__name__}.forward")
    return twin, notes


def logits_alone(model: torch.nn.Module, sequence: torch.Tensor, **kwargs) -> torch.Tensor:
    """Logits [S, V] of ``sequence`` (LongTensor [S]) run alone, on the model's device.

    ``kwargs`` go to the model (e.g. vision inputs); ``use_cache=False`` always.
    """
    device = next(model.parameters()).device
    return model(input_ids=sequence[None].to(device), use_cache=False, **kwargs).logits[0]


def logprobs_alone(model: torch.nn.Module, sequence: torch.Tensor, temperature: float = 1.0,
                   **kwargs) -> torch.Tensor:
    """Log-probs [S - 1]: entry ``t - 1`` is ``log p(sequence[t] | sequence[:t])`` (in at least float32)."""
    return logprobs_of(logits_alone(model, sequence, **kwargs), sequence, temperature)


def logprobs_of(logits: torch.Tensor, sequence: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [S - 1] of ``sequence`` [S] from its own logits [S, V] (the last row unused), in at
    least float32: entry ``t - 1`` is ``log p(sequence[t] | sequence[:t])``."""
    logits = logits[:-1]
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, sequence[1:, None].to(lp.device))[:, 0]


class CallerState:
    """The caller's parameters and their gradients (objects and version counters), to prove verify left them
    alone: :meth:`check` raises (after undoing what it can) if either changed."""

    def __init__(self, model: torch.nn.Module):
        self.params = list(model.named_parameters())
        self.before = [(p._version, p.grad, None if p.grad is None else p.grad._version) for _, p in self.params]

    def check(self) -> None:
        changed = []
        for (name, p), (v, g, gv) in zip(self.params, self.before):
            if p._version != v or p.grad is not g or (g is not None and g._version != gv):
                changed.append(name)
                if g is None:
                    p.grad = None
        if changed:
            raise RuntimeError(
                f"flexgroup.verify changed the caller's model ({changed[0]}" + (f" and {len(changed) - 1} more"
                if len(changed) > 1 else "") + "): its copies still ran the caller's modules (something on the "
                "model, an instance-level forward or a hook, refers to the original). No verdict; please report it")
