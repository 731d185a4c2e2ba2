"""Fake-CUDA traces: flexgroup's CUDA branches run on fake ``cuda:0`` tensors on a CPU-only build.

No GPU has been lent to this project, so the CUDA branches (the lse backend's CUDA kernels, FlexAttention
through its compiled and eager entry points, the carriers and plans on a cuda device, streaming and the
sequence-parallel kernel wrapper) are traced here with ``FakeTensorMode`` (``tests/_fake_cuda.py``):
every output must be a cuda tensor of the expected dtype and shape, and no op may mix a cuda tensor with a
non-scalar CPU tensor (``DeviceCheck`` raises ``MixedDevices``). A planted bug (a mask built on the CPU in
the CUDA path) must be caught.

What cannot run under fake tensors, and why (each skipped or left out with this reason):

- **backward through autograd**: the autograd engine asks the CUDA runtime for streams (CPU-only torch 2.13:
  "Cannot access accelerator device when none is available"), so model traces run the forward under
  ``torch.no_grad()``; the lse backend's backward (its autograd Function's static ``backward``, every part's
  CUDA flash / efficient backward kernel) is traced by calling it directly. The sdpa and flex backends'
  backward are torch's own autograd formulas and are not traced.
- **inductor**: compiled flex on CUDA normally goes through inductor, which emits Triton kernels (no Triton
  and no CUDA here); the compiled entry point is traced with dynamo + ``aot_eager`` instead (the same graph
  capture, guards and block-mask plumbing, FlexAttention's reference implementation underneath).
- **numbers**: fake tensors have none; exactness is tested on CPU and by ``benchmarks/gpu_check.py`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.models.zoo import build_model, unavailable

import _fake_cuda as fc  # tests/_fake_cuda.py, the test tool (tests/ is on sys.path: tests/conftest.py)

_WHY = fc.available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"fake-CUDA traces unavailable: {_WHY}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = ["lse", "sdpa", "flex_eager", "flex"]
V = 128


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def compiled_flex_without_inductor():
    with fc.cuda_flex_without_inductor():
        yield


def _groups():
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, V, (n,), generator=g)  # noqa: E731
    return [ids(17), ids(9)], [[ids(4), ids(6), ids(1)], [ids(5), ids(3)]]


def _assert_cuda(t: torch.Tensor, dtype: torch.dtype, shape: tuple, what: str):
    assert t.device == fc.DEVICE, f"{what}: on {t.device}, not cuda:0"
    assert t.dtype == dtype, f"{what}: dtype {t.dtype}, expected {dtype}"
    assert tuple(t.shape) == shape, f"{what}: shape {tuple(t.shape)}, expected {shape}"


def _trace(model, batch, dtype):
    """The grouped forward on fake cuda: (logits, logprobs, check)."""
    with fc.fake_cuda() as check:
        fc.to_fake_cuda(model, dtype)
        out = model(**batch.model_inputs(fc.DEVICE))
        lp = batch.logprobs(out.logits)
    return out.logits, lp, check


def _backend_ctx(backend, request):
    if backend == "flex":
        request.getfixturevalue("compiled_flex_without_inductor")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_llama_grouped_forward_runs_on_cuda_tensors_only(backend, dtype, request):
    _backend_ctx(backend, request)
    prompts, responses = _groups()
    batch = GroupedBatch.from_groups(prompts, responses)
    model = flexgroup.patch(build_model("llama", dtype=torch.float32), backend=backend)
    logits, lp, check = _trace(model, batch, dtype)
    _assert_cuda(logits, dtype, (1, batch.num_tokens, V), "logits")
    _assert_cuda(lp, torch.float32 if dtype != torch.float64 else dtype, tuple(batch.response_mask.shape), "logprobs")
    assert check.cuda_ops > 50, check.cuda_ops
    if backend.startswith("flex"):
        assert "flex_attention" in " ".join(check.op_names)
    else:
        assert not any("flex" in n for n in check.op_names)


@pytest.mark.parametrize("backend", ["lse", "sdpa", "flex_eager"])
def test_hybrid_tree_forward_runs_on_cuda_tensors_only(backend):
    if unavailable("qwen3_5_text"):
        pytest.skip(unavailable("qwen3_5_text"))
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, V, (n,), generator=g)  # noqa: E731
    a, b = ids(20), ids(7)
    seqs = [torch.cat([a, b, ids(5)]), torch.cat([a[:12], ids(6)]), torch.cat([a, b, ids(2)])]
    batch = GroupedBatch.from_sequences(seqs)
    model = flexgroup.patch(build_model("qwen3_5_text", dtype=torch.float32), backend=backend)
    logits, lp, _ = _trace(model, batch, torch.bfloat16)
    _assert_cuda(logits, torch.bfloat16, (1, batch.num_tokens, V), "logits")
    _assert_cuda(lp, torch.float32, tuple(batch.response_mask.shape), "logprobs")


@pytest.mark.parametrize("backend", ["lse", "sdpa"])
def test_vision_language_forward_runs_on_cuda_tensors_only(backend):
    """Qwen2-VL: the vision tower (its own attention), the scatter of features and the M-RoPE ids on cuda."""
    from tests.patches.test_vl import case, make_vl

    from flexgroup.data.multimodal import MultimodalGroupedBatch

    model = make_vl("qwen2_vl")
    prompts, responses, vision = case("two_groups", "qwen2_vl")
    batch = MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)
    flexgroup.patch(model, backend=backend)
    logits, lp, check = _trace(model, batch, torch.bfloat16)
    _assert_cuda(logits, torch.bfloat16, (1, batch.num_tokens, model.config.text_config.vocab_size), "logits")
    _assert_cuda(lp, torch.float32, tuple(batch.response_mask.shape), "logprobs")


def test_needed_logits_only_rows_on_cuda():
    prompts, responses = _groups()
    model = flexgroup.patch(build_model("llama", dtype=torch.float32), backend="lse")
    batch = GroupedBatch.from_groups(prompts, responses)
    with fc.fake_cuda():
        fc.to_fake_cuda(model, torch.bfloat16)
        out = model(**batch.model_inputs(fc.DEVICE, needed_logits_only=True))
        lp = batch.logprobs(out.logits)
    _assert_cuda(out.logits, torch.bfloat16, (1, len(batch.logit_rows), V), "needed logits")
    _assert_cuda(lp, torch.float32, tuple(batch.response_mask.shape), "logprobs")


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_text"])
def test_streaming_over_budget_runs_on_cuda_tensors_only(arch):
    """stream_logprobs with a prompt longer than the budget: the shared prompt's kept keys/values (and a
    hybrid's kept states) and every chunk's forward stay on cuda."""
    if unavailable(arch):
        pytest.skip(unavailable(arch))
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, V, (300,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(3, V, (n,), generator=g)]) for n in (5, 9, 2)]
    model = flexgroup.patch(build_model(arch, dtype=torch.float32), backend="lse")
    with fc.fake_cuda() as check:
        fc.to_fake_cuda(model, torch.bfloat16)
        lp = flexgroup.stream_logprobs(model, seqs, budget=128)
    assert tuple(lp.shape) == (len(seqs), max(len(s) for s in seqs))
    assert check.cuda_ops > 100


@pytest.mark.parametrize("world", [1, 2])
def test_sequence_parallel_kernel_wrapper_on_cuda(monkeypatch, world):
    """flexgroup.kernels.ulysses.attention as rank 0 of ``world``: the head split (KV heads replicated where
    needed), both all-to-alls and the backend on the whole padded row run on cuda. The collective is a local
    stand-in (gloo cannot move cuda tensors; fake tensors carry no data): its buffers have the real sizes."""
    import torch.distributed as dist

    from flexgroup import Layout
    from flexgroup.kernels import resolve, ulysses

    def all_to_all_single(out, x, recv, send, group=None):
        assert out.numel() == sum(recv) and x.numel() == sum(send) and out.device == x.device
        return out.copy_(x) if out.numel() == x.numel() else out

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    lay = Layout.group(19, [5, 4]).padded(world)
    c = lay.num_tokens // world
    for name in ("lse", "sdpa"):
        b = resolve(name, "cuda", False)
        with fc.fake_cuda() as check:
            q = torch.randn(1, 4, c, 16, device=fc.DEVICE, dtype=torch.bfloat16)
            k = torch.randn(1, 1, c, 16, device=fc.DEVICE, dtype=torch.bfloat16)    # 1 KV head: replicated
            plan = b.prepare(lay, None, None, fc.DEVICE)
            out = ulysses.attention(b, plan, q, k, k, 0.25, group=object())
        _assert_cuda(out, torch.bfloat16, tuple(q.shape), f"ulysses {name}")
        assert check.cuda_ops > 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_lse_cuda_backward_kernels_trace_with_merged_outputs(dtype):
    """The lse backend's CUDA backward (flash for bf16/fp16, efficient for float32), called directly."""
    from flexgroup.kernels import lse_ops

    with fc.fake_cuda() as check:
        q = torch.randn(2, 4, 8, 16, device=fc.DEVICE, dtype=dtype)
        k = torch.randn(2, 2, 8, 16, device=fc.DEVICE, dtype=dtype)
        o, lse, aux = lse_ops.part_forward(q, k, k, causal=True, scale=0.25)
        grads = lse_ops.part_backward(torch.ones_like(o), q, k, k, o, lse, aux, causal=True, scale=0.25)
    _assert_cuda(o, dtype, tuple(q.shape), "o")
    assert lse.device == fc.DEVICE and tuple(lse.shape) == (2, 4, 8)
    for g, like in zip(grads, (q, k, k)):
        _assert_cuda(g, dtype, tuple(like.shape), "grad")
    assert any(n.startswith("aten._scaled_dot_product_") for n in check.op_names), check.op_names


class _Ctx:
    """What an autograd Function's static forward / backward read from ``ctx`` (autograd itself cannot run
    on fake cuda tensors here)."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 4])
def test_lse_backend_forward_and_backward_plan_on_cuda(dtype, window, monkeypatch):
    """The lse backend's whole autograd Function on a tree (with a sliding window: padded, patterned parts):
    forward, then backward from the merged output and LSE, every part on cuda; dq, dk, dv of q/k/v's shapes.
    A grid of 4: cells the window of 4 leaves whole run the fused kernels, the ones it cuts are masked."""
    from flexgroup import Layout, patterns
    from flexgroup.kernels import lse_plan, resolve
    from flexgroup.kernels.lse import LseAttention

    monkeypatch.setattr(lse_plan, "CHUNK", 4)

    lay = Layout.tree([-1, 0, 0, 2, 0], [13, 6, 4, 3, 1])
    pattern = None if window is None else patterns.sliding_window(window)
    b = resolve("lse", "cuda", True)
    ctx = _Ctx()
    with fc.fake_cuda() as check:
        q = torch.randn(1, 4, lay.num_tokens, 16, device=fc.DEVICE, dtype=dtype)
        k = torch.randn(1, 2, lay.num_tokens, 16, device=fc.DEVICE, dtype=dtype)
        plan = b.prepare(lay, pattern, None, fc.DEVICE)
        o = LseAttention.forward(ctx, q, k, k, plan.data, 0.25)
        dq, dk, dv, *_ = LseAttention.backward(ctx, torch.ones_like(o))
    _assert_cuda(o, dtype, tuple(q.shape), "o")
    for g, like in ((dq, q), (dk, k), (dv, k)):
        _assert_cuda(g, dtype, tuple(like.shape), "grad")
    assert any("_backward" in n for n in check.op_names), sorted(check.op_names)


def test_a_mask_built_on_the_cpu_in_the_cuda_path_is_caught(monkeypatch):
    """The planted bug: the sdpa backend's segment masks built on the CPU whatever the device."""
    from flexgroup.kernels import sdpa

    build = sdpa.SdpaBackend.prepare

    def cpu_masks(self, layout, pattern, score_mod, device, **kw):
        return build(self, layout, pattern, score_mod, torch.device("cpu"), **kw)

    monkeypatch.setattr(sdpa.SdpaBackend, "prepare", cpu_masks)
    prompts, responses = _groups()
    batch = GroupedBatch.from_groups(prompts, responses)
    model = flexgroup.patch(build_model("llama", dtype=torch.float32), backend="sdpa")
    with pytest.raises(fc.MixedDevices, match="cuda.*cpu|cpu.*cuda"):
        _trace(model, batch, torch.float32)


def test_mixed_devices_checker_allows_transfers_and_cpu_scalars_only():
    with fc.fake_cuda() as check:
        x = torch.ones(3, device=fc.DEVICE)
        y = x * torch.tensor(2.0) + torch.arange(3).to(fc.DEVICE)   # a CPU scalar, a transfer
        assert y.device == fc.DEVICE
        with pytest.raises(fc.MixedDevices, match=r"aten\.add"):
            x + torch.arange(3)
        assert torch.arange(4).sum().item() == 6                     # CPU ops run for real
    assert check.real_ops >= 2
