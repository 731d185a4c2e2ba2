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

__all__ = ["logits_alone", "logprobs_alone", "logprobs_of", "own_copy", "unsharded_copy", "fsdp2_modules"]


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

    An FSDP2-sharded model (``fully_shard``) refuses ``deepcopy``: its copy is rebuilt unsharded
    instead (:func:`unsharded_copy`, a collective: every rank of its mesh must call this together).
    """
    if fsdp2_modules(model):
        return unsharded_copy(model)
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


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:  # pragma: no cover - older torch
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def fsdp2_modules(model: torch.nn.Module) -> list[str]:
    """Names of the FSDP2-sharded (``fully_shard``) modules inside ``model`` ("" for the model itself)."""
    cls = _fsdp_module_class()
    return [] if cls is None else [name for name, m in model.named_modules() if isinstance(m, cls)]


def _plain_class(module: torch.nn.Module) -> type:
    """The module's own class: FSDP2 swaps in a subclass ``FSDP<Name>(FSDPModule, <Name>)``."""
    fsdp = _fsdp_module_class()
    return next(c for c in type(module).__mro__ if fsdp is None or not issubclass(c, fsdp))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter or buffer, detached, on its local shard's device.

    A DTensor is all-gathered over its mesh (a collective); a shard offloaded to the CPU (FSDP2's
    ``CPUOffloadPolicy``) travels to the mesh's device for the gather and back."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.detach().clone()
    local = t.to_local()
    mesh = t.device_mesh
    if local.device.type != mesh.device_type:
        mod = getattr(torch, mesh.device_type)
        gathered = DTensor.from_local(local.to(torch.device(mesh.device_type, mod.current_device())), mesh,
                                      t.placements, shape=t.shape, stride=t.stride())
        return gathered.full_tensor().to(local.device)
    return t.full_tensor()


def unsharded_copy(model: torch.nn.Module) -> tuple[torch.nn.Module, list[str]]:
    """An unsharded copy of an FSDP2-sharded model, with its full weights; returns ``(copy, notes)``.

    FSDP2 refuses ``deepcopy``. The copy is the model's own class (FSDP's subclass stripped) built from
    a deep copy of its config on the meta device, then given every parameter's full value (sharded
    ones all-gathered over their mesh: **a collective**, every rank must call it together), every
    buffer and every other tensor attribute, on each local shard's device. It runs the class's code:
    a submodule of another class than the class builds or a missing or extra parameter cannot be
    reproduced and raises ``ValueError`` naming it (patch or verify the model before ``fully_shard``
    instead); an instance-level ``forward`` is kept where it is a method bound to its own module, else
    the copy runs its class's ``forward`` (as :func:`own_copy` does for TRL's fused head) and a note says so.
    """
    from types import MethodType

    cls = _plain_class(model)
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"an FSDP2-sharded {cls.__name__} without .config cannot be rebuilt unsharded: copy "
                         "(patch / verify) the model before fully_shard")
    with torch.device("meta"):
        twin = cls(copy.deepcopy(config))
    originals = dict(model.named_modules())
    copies = dict(twin.named_modules())
    fix = "patch or verify the model before fully_shard, where it can be deep-copied"
    if originals.keys() != copies.keys():
        extra = sorted(originals.keys() ^ copies.keys())
        raise ValueError(f"FSDP2 model: {cls.__name__}(config) does not rebuild its module tree (module "
                         f"{extra[0]!r} differs): {fix}")
    notes = []
    with torch.no_grad():
        for name, m in originals.items():
            c = copies[name]
            if _plain_class(m) is not type(c):
                raise ValueError(f"FSDP2 model: module {name!r} is a {_plain_class(m).__name__} where "
                                 f"{cls.__name__}(config) builds a {type(c).__name__}: {fix}")
            if (m._parameters.keys() != c._parameters.keys()) or (m._buffers.keys() != c._buffers.keys()):
                raise ValueError(f"FSDP2 model: module {name!r} holds other parameters or buffers than "
                                 f"{cls.__name__}(config) builds: {fix}")
            for key, p in m._parameters.items():
                if p is not None:
                    c._parameters[key] = torch.nn.Parameter(_full(p), requires_grad=p.requires_grad)
            for key, b in m._buffers.items():
                if b is not None:
                    c._buffers[key] = b.detach().clone()
            for key, v in vars(m).items():
                if isinstance(v, torch.Tensor) and not key.startswith("_"):
                    c.__dict__[key] = v.detach().clone()
            fwd = m.__dict__.get("forward")
            if fwd is not None:
                if isinstance(fwd, MethodType) and fwd.__self__ is m:
                    c.forward = MethodType(fwd.__func__, c)
                else:
                    notes.append(f"{name or cls.__name__}.forward was replaced on the instance: the unsharded "
                                 f"copy runs {type(c).__name__}.forward")
    left = [n for n, t in (*twin.named_parameters(), *twin.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"FSDP2 model: {left[0]!r} has no value to copy from the sharded model: {fix}")
    notes.append(f"FSDP2-sharded: the copy is {cls.__name__} rebuilt unsharded from the config and the full weights")
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
        bad = next((n for n, p in self.params if p.is_inference()), None)
        if bad is not None:  # they keep no version counter, and no gradient can reach them
            raise ValueError(f"verify: parameter {bad!r} is an inference tensor (the model was built or loaded under "
                             "torch.inference_mode()), so it can take no gradient: load the model outside inference mode")
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
