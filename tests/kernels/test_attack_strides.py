"""Attention backends given q, k, v (and output gradients) with unusual strides.

Oracle: ``_core_reference.reference_attention`` (each root-to-leaf sequence attended alone with an
explicit softmax) on contiguous copies of the same values; gradients by autograd through it. Every
backend that runs on CPU in seconds (``sdpa``, ``flex_eager``, ``lse``; compiled ``flex`` takes a
compile per shape and is covered for layouts in ``test_attention.py``) must give the same output and
the same dq, dk, dv for every memory layout of the inputs:

- ``fused``: q, k, v slices of one fused projection ``[1, L, 3, H, D]`` (token stride 3 H D);
- ``head_strided``: every other element of the head dimension (``x[..., ::2]``, stride(-1) 2);
- ``d_major``: stored ``[1, H, D, L]`` and transposed (stride(-1) L);
- ``expanded_grad``: contiguous inputs, the output gradient of ``out.sum()`` (all strides 0).

``flex_eager`` has no backward on CPU (it refuses to train there): its output alone is compared.

The ``lse`` backend calls the fused aten kernels directly, which read the head dimension as if its
stride were 1: without :func:`flexgroup.kernels.lse_ops.unit_last` it was 2.2 off (``head_strided``)
and NaN or 1e20 (``d_major``) -- the broken variant below shows the test sees it. (The stride-0
gradient of ``expanded_grad`` came out right even without it; it stays covered.)
"""

from __future__ import annotations

import pytest
import torch

from _core_reference import one_torch_thread, reference_attention  # noqa: F401
from flexgroup import Layout, patterns as P
from flexgroup.kernels import lse_plan, attention, lse_ops

TOL = {torch.float64: 1e-12, torch.float32: 5e-5}
HQ, HKV, D = 4, 2, 8
LAYOUTS = {
    "tree": (Layout.tree([-1, 0, 1, 1, 2, 2, 3, 0], [6, 4, 3, 5, 2, 6, 3, 7]), None),
    "pack_window": (Layout.pack([Layout.group(8, [2, 5]), Layout.tree([-1], [13])]), P.sliding_window(4)),
}
MEMORY = ["contiguous", "fused", "head_strided", "d_major", "expanded_grad"]


def _values(L: int, dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, L, D, generator=g, dtype=torch.float64).to(dtype) for h in (HQ, HKV, HKV)]


def _laid_out(x: torch.Tensor, memory: str) -> torch.Tensor:
    """The same values ``[1, H, L, D]`` in another memory layout (a leaf that requires grad)."""
    _, H, L, _ = x.shape
    if memory == "fused":      # one [1, L, 3, H, D] projection, this tensor its slot 1
        big = torch.zeros(1, L, 3, H, D, dtype=x.dtype)
        big[:, :, 1] = x.transpose(1, 2)
        big.requires_grad_()
        return big, big[:, :, 1].transpose(1, 2)
    if memory == "head_strided":
        big = torch.zeros(1, H, L, 2 * D, dtype=x.dtype)
        big[..., ::2] = x
        big.requires_grad_()
        return big, big[..., ::2]
    if memory == "d_major":
        big = x.transpose(-1, -2).contiguous().requires_grad_()
        return big, big.transpose(-1, -2)
    leaf = x.clone().requires_grad_()
    return leaf, leaf


def _run(backend: str, lay, pattern, dtype, memory: str):
    """(out, dq, dk, dv) of ``backend`` on the laid-out inputs, and of the reference on contiguous ones."""
    vals = _values(lay.num_tokens, dtype)
    leaves, views = zip(*(_laid_out(x, memory) for x in vals))
    assert memory == "contiguous" or memory == "expanded_grad" or any(v.stride(-1) != 1 or not v.is_contiguous()
                                                                      for v in views)
    refs = [x.clone().requires_grad_() for x in vals]
    rout = reference_attention(*refs, lay, pattern=pattern)
    if backend == "flex_eager":   # forward only on CPU
        with torch.no_grad():
            return (attention(*(x.detach() for x in views), lay, pattern=pattern, backend=backend),), (rout,)
    out = attention(*views, lay, pattern=pattern, backend=backend)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    loss = out.sum() if memory == "expanded_grad" else (out * w).sum()
    grads = torch.autograd.grad(loss, leaves)
    # gradients of the views (the part of each leaf the view covers)
    grads = [_laid_out_grad(gr, memory) for gr in grads]
    rloss = rout.sum() if memory == "expanded_grad" else (rout * w).sum()
    return (out, *grads), (rout, *torch.autograd.grad(rloss, refs))


def _laid_out_grad(g: torch.Tensor, memory: str) -> torch.Tensor:
    if memory == "fused":
        return g[:, :, 1].transpose(1, 2)
    if memory == "head_strided":
        return g[..., ::2]
    if memory == "d_major":
        return g.transpose(-1, -2)
    return g


def _errors(got, ref) -> list[float]:
    return [(a.double() - b.double()).abs().max().item() for a, b in zip(got, ref)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize("backend", ["sdpa", "flex_eager", "lse"])
def test_every_memory_layout_gives_the_same_output_and_gradients(backend, memory, layout, dtype):
    lay, pattern = LAYOUTS[layout]
    errs = _errors(*_run(backend, lay, pattern, dtype, memory))
    assert max(errs) <= TOL[dtype], f"{backend} {memory}: (out, dq, dk, dv) errors {errs}"


def _fused_kernel_reads_strides(memory: str) -> bool:
    """Whether this torch's fused CPU attention kernel itself gives the same output for ``memory``'s layout as
    for contiguous inputs (torch 2.14 does for ``head_strided``; 2.13 read stride(-1) as 1)."""
    q = _values(16, torch.float64)[0]
    view = _laid_out(q, memory)[1].detach()
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return torch.allclose(kernel(view, view, view, 0.0, True)[0], kernel(q, q, q, 0.0, True)[0], atol=1e-12)


@pytest.mark.parametrize("memory", ["head_strided", "d_major"])
def test_lse_without_unit_last_is_caught(monkeypatch, memory):
    """Broken on purpose: the fused kernels given the strided tensors as they come. Where this torch's kernel
    reads that layout right by itself there is nothing for the broken variant to break: said, not asserted."""
    monkeypatch.setattr(lse_ops, "unit_last", lambda x: x)
    monkeypatch.setattr(lse_plan, "CHUNK", 3)
    # one path of 8 whole cells of 3: the causal squares' queries and every full cell's keys are slices of the
    # row (views with its strides), not gathered copies
    lay, pattern = Layout.tree([-1, 0], [12, 12]), None
    errs = _errors(*_run("lse", lay, pattern, torch.float64, memory))
    if max(errs) <= TOL[torch.float64] and _fused_kernel_reads_strides(memory):
        pytest.skip(f"torch {torch.__version__}'s fused CPU attention kernel reads {memory} inputs right itself "
                    "(the unit_last guard is for the torch releases whose kernel does not)")
    assert not max(errs) <= TOL[torch.float64], f"{memory}: the broken variant agreed ({errs})"


def test_unit_last_copies_only_when_the_head_dimension_is_strided():
    x = torch.randn(2, 3, 4, 6)
    assert lse_ops.unit_last(x) is x
    assert lse_ops.unit_last(x[:, :, 1:]) is not None and lse_ops.unit_last(x[:, :, 1:]).data_ptr() == x[:, :, 1:].data_ptr()
    y = lse_ops.unit_last(x[..., ::2])
    assert y.stride(-1) == 1 and torch.equal(y, x[..., ::2])
    z = lse_ops.unit_last(torch.zeros(()).expand(2, 3))
    assert z.stride(-1) == 1 and z.shape == (2, 3)
