"""A float64 run of a model too large for a float64 copy: one block's weights in float64 at a time.

verify's ``"layerwise"`` calibration (:mod:`flexgroup.verification.calibration`). The float64 truth of a stock run
normally comes from a float64 deep copy of the model -- 8 bytes per parameter, plus its gradients. Here
the model's own float32 (or bf16) parameters are used instead:

- :class:`Upcast`, a ``TorchFunctionMode``: every floating tensor an op receives is cast to float64
  (parameters and buffers included; the cast is differentiable, so gradients reach each parameter's
  ``.grad``), and every request for a lower precision -- ``.float()``, ``.to(torch.float32)``,
  ``dtype=torch.float32`` (HF's RMSNorm and eager softmax), the default dtype of new tensors -- stays
  float64. The values are exactly the model's weights; every operation runs in float64.
- :func:`float64_by_layer`: :class:`Upcast` over a forward and backward, with each block (every child
  of the model's outermost ``nn.ModuleList`` s, and the output embedding) under non-reentrant
  checkpointing whose recomputation runs under :class:`Upcast` too. Autograd then keeps only the
  blocks' inputs; the float64 casts of one block's weights exist at a time (its forward, then its
  recomputation in the backward).

What it costs: about one block's weights in float64 (and the output embedding's, while the logits are
computed) beyond the model, float64 activations, one recomputed forward, and the mode's Python hook on
every op. The gradients it leaves are the float64 gradients rounded once to the parameter's dtype
(float32: relative 6e-8, far below the float32 noise floor of 1e-6 to 1e-3 that it calibrates),
accumulated in that dtype over the sequences of one verify.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

__all__ = ["Upcast", "float64_scope", "float64_by_layer", "blocks"]

_UP = {torch.float32: torch.float64, torch.float16: torch.float64, torch.bfloat16: torch.float64,
       torch.complex64: torch.complex128, torch.complex32: torch.complex128}
_LOWERING = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)
_AS_IS = frozenset({"__get__", "__set__", "size", "dim", "numel", "__len__", "is_floating_point", "is_complex",
                    "element_size", "data_ptr", "stride", "is_contiguous", "requires_grad_", "register_hook"})


def _up(x):
    if isinstance(x, torch.Tensor) and x.dtype in _UP:
        return x.to(_UP[x.dtype])
    if isinstance(x, torch.dtype):
        return _UP.get(x, x)
    return x


_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"})


def _inplace(func, kwargs: dict) -> bool:
    """Whether ``func`` writes into its first argument (``x.mul_(y)``, ``x[i] = y``, ``out=``)."""
    name = getattr(func, "__name__", "")
    return "out" in kwargs or (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS


class Upcast(TorchFunctionMode):
    """Inside, ops compute in float64 whatever the dtype of their floating inputs (see the module
    docstring). An in-place op on a lower-precision tensor is left alone (casting its target would
    write into a copy); its other inputs are cast only when the target is float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name in _AS_IS:  # attribute access (``p.grad``, ``x.dtype``) and shape queries: nothing computed
            return func(*args, **kwargs)
        if func in _LOWERING and args and isinstance(args[0], torch.Tensor):
            x = args[0]
            return x if x.dtype in (torch.float64, torch.complex128) else x.to(torch.float64)
        if _inplace(func, kwargs):
            target = args[0] if args else None
            if isinstance(target, torch.Tensor) and target.dtype in _UP.values():
                args = (target, *tree_map(_up, tuple(args[1:])))
                kwargs = tree_map(_up, kwargs)
            return func(*args, **kwargs)
        return func(*tree_map(_up, tuple(args)), **tree_map(_up, kwargs))


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules :func:`float64_by_layer` checkpoints: the children of every outermost
    ``nn.ModuleList`` (decoder layers, a vision tower's blocks) that hold parameters, and the output
    embedding (the LM head's float64 weight would otherwise be kept for the backward)."""
    out, inside = [], set()
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and not any(name.startswith(p + ".") for p in inside):
            inside.add(name)
            out += [c for c in m if next(c.parameters(), None) is not None]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and all(head is not b for b in out):
        out.append(head)
    return out


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False,
                          context_fn=lambda: (contextlib.nullcontext(), float64_scope()), **kwargs)
    return run


@contextlib.contextmanager
def float64_scope() -> Iterator[None]:
    """:class:`Upcast` with float64 as the default dtype of new tensors (restored on exit)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with Upcast():
            yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def float64_by_layer(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model``'s forwards and backwards inside the block in float64 from its own parameters.

    The model's blocks (:func:`blocks`) get an instance-level ``forward`` that checkpoints the one
    they had (the class's, or one set on the instance); it is restored on exit, as is the default dtype. Use it
    around a forward *and* its backward (the recomputation happens in the backward). Gradients accumulate into
    the parameters' ``.grad`` (in their own dtype): swap them out first if they hold something else.

    Every module's buffers and tensor-valued attributes are restored on exit too (:class:`_TensorState`): a
    module that caches tables during forward (rotary cos/sin, masks) or updates a buffer would otherwise keep
    the float64 ones, and the model's next ordinary run would not be the stock run any more.
    """
    state = _TensorState(model)
    wrapped = []  # (block, the forward it had on the instance or None)
    for b in blocks(model):
        wrapped.append((b, b.__dict__.get("forward")))
        b.forward = _checkpointed(b.forward)  # the class's, or one set on the instance (accelerate's hooks)
    try:
        with float64_scope():
            yield
    finally:
        for b, had in wrapped:
            if had is None:
                del b.__dict__["forward"]
            else:
                b.forward = had
        state.restore()


def _holds_tensor(v) -> bool:
    if isinstance(v, (tuple, list)):
        return any(isinstance(x, torch.Tensor) for x in v)
    if isinstance(v, dict):
        return any(isinstance(x, torch.Tensor) for x in v.values())
    return isinstance(v, torch.Tensor)


class _TensorState:
    """Each module's buffers and tensor-holding attributes (a tensor, or a tuple / list / dict of them; not
    parameters), kept by object and by value (clones: buffers and caches are small beside the weights).
    :meth:`restore` puts back replaced objects, undoes in-place edits and removes tensors attached since."""

    def __init__(self, model: torch.nn.Module):
        self.items = []  # (module, its buffers dict, its attributes, clones of the tensors they hold by id)
        for m in model.modules():
            attrs = dict(vars(m))
            values = {}
            for v in [*m._buffers.values(), *(v for v in attrs.values() if _holds_tensor(v))]:
                for t in (v.values() if isinstance(v, dict) else v if isinstance(v, (tuple, list)) else [v]):
                    if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and not t.is_inference():
                        values[id(t)] = (t, t._version, t.detach().clone())
            self.items.append((m, dict(m._buffers), attrs, values))

    @torch.no_grad()
    def restore(self) -> None:
        for m, buffers, attrs, values in self.items:
            m._buffers.clear()
            m._buffers.update(buffers)
            now = vars(m)
            for k in set(now) | set(attrs):
                old, new = attrs.get(k, _MISSING), now.get(k, _MISSING)
                if old is not new and (_holds_tensor(old) or _holds_tensor(new)):
                    if old is _MISSING:
                        del now[k]   # a tensor cached during the run
                    else:
                        now[k] = old
            for t, version, clone in values.values():
                if t._version != version:
                    t.copy_(clone)


_MISSING = object()
