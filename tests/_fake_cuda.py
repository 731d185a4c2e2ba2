"""Fake-CUDA traces: run flexgroup's CUDA branches on a CPU-only build, for shapes, dtypes and devices.

``torch._subclasses.fake_tensor.FakeTensorMode`` builds fake ``cuda`` tensors without a GPU (no data,
only shape, dtype, device and strides), so every op of a CUDA code path -- the lse backend's CUDA
kernels, FlexAttention's block masks, the carriers, the model's own layers -- runs its meta
implementation. :func:`fake_cuda` adds :class:`DeviceCheck` on top: every op that mixes a ``cuda``
tensor with a non-scalar CPU tensor raises :class:`MixedDevices` naming the op and the tensors (a
mask or an index built on the CPU in a CUDA path is exactly that). Ops on real CPU tensors only (the
plans flexgroup computes from the layout) run for real, so their values stay available, as they are
on a GPU machine.

What fake tensors cannot show (the tests say so where it matters):

- **numbers**: fake tensors have none; exactness is tested on CPU and by ``benchmarks/gpu_check.py``
  on a GPU;
- **backward**: the autograd engine asks the CUDA runtime for streams whenever a ``cuda`` tensor
  requires grad (measured, torch 2.13 CPU build: the process aborts in ``InputMetadata`` when the
  graph is built, and ``backward`` raises "Cannot access accelerator device" even with a no-op CUDA
  device guard), so traces run forward under ``torch.no_grad()`` and backward kernels are traced by
  calling them directly;
- **values on the device**: fake tensors have none. Small integer tensors (at most 4,096 elements: image
  grids, counts, offsets) moved to the device keep a real CPU copy, propagated through ops on them, so
  that host reads of them (``.tolist()``, ``.item()``: a sync on a GPU, e.g. transformers' vision towers
  read ``grid_thw``) return the value a GPU would; ``DeviceCheck.host_reads`` counts them. A host read of
  any other device value raises (``DataDependentOutputException``).

A CPU-only build has no CUDA device guard, and indexing a fake cuda tensor (``x[None]``) or building
an autograd node for one asks for it ("PyTorch is not linked with support for cuda devices"):
:func:`install_cuda_guard` compiles (once, a few seconds, with the C++ compiler torch's extensions use)
and loads a no-op CUDA device guard whose streams are CPU streams.

Spell the device ``cuda:0``: ``Tensor.to("cuda")`` without an index asks the CUDA runtime for the
current device and fails on a CPU-only build even under FakeTensorMode.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["DEVICE", "MixedDevices", "DeviceCheck", "fake_cuda", "to_fake_cuda", "available", "install_cuda_guard",
           "cuda_flex_without_inductor"]

_GUARD_SRC = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
namespace {
using c10::Device;
using c10::DeviceType;
using c10::Stream;
// A no-op CUDA device guard for CPU-only builds (fake cuda tensors only); its streams are CPU streams.
struct FakeCudaGuard final : public c10::impl::NoOpDeviceGuardImpl<DeviceType::CUDA> {
  Stream getStream(Device) const noexcept override { return Stream(Stream::DEFAULT, Device(DeviceType::CPU, -1)); }
  Stream getNewStream(Device, int) const override { return Stream(Stream::DEFAULT, Device(DeviceType::CPU, -1)); }
  Stream exchangeStream(Stream) const noexcept override { return Stream(Stream::DEFAULT, Device(DeviceType::CPU, -1)); }
};
FakeCudaGuard guard;
struct Register {
  Register() {
    auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(DeviceType::CUDA)];
    if (slot.load() == nullptr) slot.store(&guard);
  }
} reg;
}
"""
_GUARD: dict[str, str | None] = {}

DEVICE = torch.device("cuda", 0)
_aten = torch.ops.aten
# ops whose purpose is to move data between devices: a cuda and a CPU tensor together are expected
_SHADOW_LIMIT = 4096  # integer tensors up to this size keep a real CPU copy of their value (host reads)
_TRANSFERS = {_aten._to_copy.default, _aten.copy_.default, _aten.copy.default, _aten._copy_from.default,
              _aten._copy_from_and_resize.default, _aten.lift_fresh.default, _aten.lift_fresh_copy.default}


class MixedDevices(RuntimeError):
    """An op received a cuda tensor and a non-scalar CPU tensor (outside a device transfer)."""


def _fake_class():
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


try:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
except ImportError:  # pragma: no cover - an older torch without them: nothing to recover from
    class DataDependentOutputException(Exception):  # type: ignore[no-redef]
        pass

    class DynamicOutputShapeException(Exception):  # type: ignore[no-redef]
        pass


def _describe(t: torch.Tensor) -> str:
    return f"{t.device.type}:{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}"


class DeviceCheck(TorchDispatchMode):
    """A dispatch mode (inside a FakeTensorMode) that refuses ops mixing cuda and non-scalar CPU tensors.

    Ops whose tensors are all real (not fake) CPU tensors, and that create no cuda tensor, run for real
    with the modes below switched off. Counters: ``ops`` (ops seen on fake tensors), ``cuda_ops`` (those
    with a cuda tensor among their inputs or a cuda ``device=``), ``real_ops`` (real CPU ops).
    """

    supports_higher_order_operators = True  # flex_attention is one: its block mask tensors are checked too

    @classmethod
    def is_infra_mode(cls) -> bool:
        # dynamo refuses to trace under a non-infra dispatch mode (flex_attention always goes through
        # torch.compile); this mode changes no op, it only checks devices and runs CPU ops for real
        return True

    def __init__(self):
        super().__init__()
        self.ops = self.cuda_ops = self.real_ops = self.host_reads = 0
        self.op_names: set[str] = set()
        self._values = WeakIdKeyDictionary()  # small int fake -> real value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fake = _fake_class()
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        dev = kwargs.get("device")
        to_cuda = dev is not None and torch.device(dev).type == "cuda"
        fakes = [t for t in tensors if isinstance(t, fake)]
        if not to_cuda and not fakes:
            self.real_ops += 1
            with _disable_current_modes():
                return func(*args, **kwargs)
        self.ops += 1
        self.op_names.add(str(getattr(func, "overloadpacket", getattr(func, "name", func))))
        types_seen = {t.device.type for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        if "cuda" in types_seen or to_cuda:
            self.cuda_ops += 1
        if len(types_seen) > 1 and func not in _TRANSFERS:
            raise MixedDevices(f"{func} received tensors on different devices: "
                               f"{', '.join(_describe(t) for t in tensors)} (a CPU tensor in a CUDA path: build it "
                               "on the device of the inputs)")
        known = bool(fakes) and all(t in self._values for t in fakes)
        if known and (func is _aten._local_scalar_dense.default or (
                func is _aten._to_copy.default and dev is not None and torch.device(dev).type == "cpu")):
            self.host_reads += 1  # a host read of small integer metadata (a sync on a GPU): its real value
            with _disable_current_modes():
                return func(*pytree.tree_map(lambda t: self._values.get(t, t) if isinstance(t, fake) else t, args),
                            **kwargs)
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            if not known:
                raise
            # an output whose shape depends on shadowed values (repeat_interleave of a grid): from the value
            where = fakes[0].device
            with _disable_current_modes():
                real = func(*pytree.tree_map(lambda t: self._values.get(t, t) if isinstance(t, fake) else t, args),
                            **kwargs)
            out = pytree.tree_map(lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=where)
                                  if isinstance(r, torch.Tensor) else r, real)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outs and all(isinstance(t, fake) and _small_ints(t) for t in outs) and (known or not fakes):
            # the value of small integer metadata (grids, counts, offsets) moved to or computed on the
            # device, shadowed on the CPU so that host reads of it return what a GPU would
            with _disable_current_modes():
                real = func(*pytree.tree_map(lambda t: self._values.get(t, t) if isinstance(t, fake) else t, args),
                            **{k: ("cpu" if k == "device" else v) for k, v in kwargs.items()})
            reals = [t for t in pytree.tree_leaves(real) if isinstance(t, torch.Tensor)]
            if len(reals) == len(outs) and all(r.shape == o.shape for r, o in zip(reals, outs)):
                for o, r in zip(outs, reals):
                    self._values[o] = r
        return out


def _small_ints(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex()) and t.numel() <= _SHADOW_LIMIT


def install_cuda_guard() -> str | None:
    """Make sure a CUDA device guard exists (a CPU-only build has none): compile and load the no-op one
    once per process. Returns why it could not (no C++ compiler, ...), or None."""
    if "why" in _GUARD:
        return _GUARD["why"]
    if torch.cuda.is_available() or torch.version.cuda is not None:
        _GUARD["why"] = "this torch is built with CUDA: use a real GPU, or FakeTensorMode's own guard"
        return _GUARD["why"]
    import hashlib
    import os
    import tempfile

    try:
        from torch.utils.cpp_extension import load

        tag = hashlib.sha1((_GUARD_SRC + torch.__version__).encode()).hexdigest()[:12]
        root = os.path.join(tempfile.gettempdir(), f"flexgroup_fake_cuda_guard_{tag}")
        os.makedirs(root, exist_ok=True)
        src = os.path.join(root, "fake_cuda_guard.cpp")
        if not os.path.exists(src):
            with open(src, "w") as f:
                f.write(_GUARD_SRC)
        load(f"flexgroup_fake_cuda_guard_{tag}", [src], is_python_module=False, build_directory=root,
             extra_cflags=["-O0"], verbose=False)
        _GUARD["why"] = None
    except Exception as e:  # noqa: BLE001 -- no compiler, no headers: the traces are skipped with this reason
        _GUARD["why"] = f"cannot build the no-op CUDA device guard: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return _GUARD["why"]


def available() -> str | None:
    """Why fake-CUDA traces cannot run with this torch (None: they can)."""
    why = install_cuda_guard()
    if why:
        return why
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            x = torch.empty(2, 3, device=DEVICE)
            if (x[None] @ x.T).device != DEVICE:
                return "FakeTensorMode did not keep the cuda device"
    except Exception as e:  # noqa: BLE001 -- any failure means: cannot trace here, and why
        return f"FakeTensorMode cannot build fake cuda tensors here: {type(e).__name__}: {e}"
    return None


@contextlib.contextmanager
def fake_cuda(check_ops: bool = True) -> Iterator[DeviceCheck]:
    """``with fake_cuda() as check:`` -- a FakeTensorMode (real tensors allowed as inputs) with a
    :class:`DeviceCheck` on top; everything runs under ``torch.no_grad()`` (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    check = DeviceCheck()
    with torch.no_grad(), mode, (check if check_ops else contextlib.nullcontext()):
        yield check


def to_fake_cuda(module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Replace ``module``'s parameters and buffers, in place, by fake ``cuda:0`` tensors (cast to ``dtype``
    if floating point and given); call inside :func:`fake_cuda`. Parameters do not require grad (see the
    module docstring: autograd over fake cuda tensors needs a CUDA runtime)."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                t = p.detach().to(DEVICE, dtype=dtype if dtype is not None and p.is_floating_point() else None)
                m._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = b.to(DEVICE, dtype=dtype if dtype is not None and b.is_floating_point() else None)
    return module


@contextlib.contextmanager
def cuda_flex_without_inductor():
    """Compiled flex on cuda through dynamo + ``aot_eager`` instead of inductor (which emits Triton kernels:
    no Triton and no CUDA here): the same graph capture, guards and block-mask plumbing, FlexAttention's
    reference implementation underneath. Compiled kernels made inside are dropped on exit."""
    from flexgroup.kernels import flex

    saved = flex.PROFILES["cuda"], dict(flex._COMPILED_FLEX), dict(flex._GRAPH_CODES)
    flex.PROFILES["cuda"] = flex.CompileProfile(None, backend="aot_eager")
    flex._COMPILED_FLEX.clear()
    try:
        yield
    finally:
        flex.PROFILES["cuda"] = saved[0]
        for d, s in zip((flex._COMPILED_FLEX, flex._GRAPH_CODES), saved[1:]):
            d.clear()
            d.update(s)
