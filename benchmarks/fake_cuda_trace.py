"""``gpu_check.py --toy``'s CUDA branches on fake ``cuda`` tensors (the test tool ``tests/_fake_cuda.py``).

The GPU run's shapes, dtypes and devices, checked on a CPU-only machine before a GPU is lent, so that
the first GPU run finds no shape or device bug. Each case runs the toy sizes on fake ``cuda:0``
tensors in bfloat16 under a dispatch mode that refuses any op mixing a cuda tensor with a non-scalar
CPU tensor:

- the exactness / P1 model point: the group (P, G x R) and a tree batch, backends ``flex`` (compiled:
  dynamo + ``aot_eager`` in place of inductor, which needs Triton), ``lse`` and ``sdpa``;
  logits ``[1, L, V]`` bf16 and log-probs ``[N, T]`` float32 on cuda;
- P6's pass: ``needed_logits_only`` logits ``[1, K, V]``;
- P10 / the streaming check: ``stream_logprobs`` over the budget (chunk forwards, kept keys and values);
- P2 / P5: ``flexgroup.attention`` on bf16 q/k/v (``flex``, ``lse``);
- the hybrid check's model (Qwen3.5 text, Gated DeltaNet) where transformers has it.

Not traceable on fake tensors (see ``tests/_fake_cuda.py``): backward (the autograd engine
needs a CUDA runtime), numbers (exactness), inductor / Triton and the FLASH backend, peak memory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import flexgroup
from flexgroup import GroupedBatch, Layout
from flexgroup.bench.contenders import make_group

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # the checkout's tests/: its fake-CUDA tool
import _fake_cuda as fc  # noqa: E402

__all__ = ["run"]


def _expect(t: torch.Tensor, dtype: torch.dtype, shape: tuple, what: str) -> None:
    if t.device != fc.DEVICE or t.dtype != dtype or tuple(t.shape) != shape:
        raise AssertionError(f"{what}: {t.device} {t.dtype} {tuple(t.shape)}, expected {fc.DEVICE} {dtype} {shape}")


def _model_case(build, batch: GroupedBatch, backend: str, vocab: int, needed: bool = False) -> None:
    model = flexgroup.patch(build(), backend=backend)
    with fc.fake_cuda():
        fc.to_fake_cuda(model, torch.bfloat16)
        logits = model(**batch.model_inputs(fc.DEVICE, needed_logits_only=needed)).logits
        lp = batch.logprobs(logits)
    rows = len(batch.logit_rows) if needed else batch.num_tokens
    _expect(logits, torch.bfloat16, (1, rows, vocab), f"{backend} logits")
    _expect(lp, torch.float32, tuple(batch.response_mask.shape), f"{backend} log-probs")


def _cases(cfg, P: int, R: int, G: int, build):
    prompt, responses = make_group(P, [R] * G, cfg.vocab_size, seed=1)
    group = GroupedBatch.from_groups([prompt], [responses])
    g = torch.Generator().manual_seed(2)
    rnd = lambda n: torch.randint(1, cfg.vocab_size, (n,), generator=g)  # noqa: E731
    sys_p, turn = rnd(P // 2), rnd(R)
    tree = GroupedBatch.from_sequences([torch.cat([sys_p, turn, rnd(R)]), torch.cat([sys_p, turn[:R // 2], rnd(R)]),
                                        torch.cat([sys_p, rnd(R)])])
    for backend in ("flex", "lse", "sdpa"):
        yield f"model group {backend}", lambda b=backend: _model_case(build, group, b, cfg.vocab_size)
        yield f"model tree {backend}", lambda b=backend: _model_case(build, tree, b, cfg.vocab_size)
    yield "needed_logits_only (P6)", lambda: _model_case(build, group, "flex", cfg.vocab_size, needed=True)

    def stream():
        long = torch.cat([prompt, rnd(300)])
        seqs = [torch.cat([long, r]) for r in responses]
        model = flexgroup.patch(build(), backend="lse")
        with fc.fake_cuda():
            fc.to_fake_cuda(model, torch.bfloat16)
            lp = flexgroup.stream_logprobs(model, seqs, budget=128)
        if tuple(lp.shape) != (len(seqs), max(len(s) for s in seqs)):
            raise AssertionError(f"stream_logprobs: shape {tuple(lp.shape)}")

    yield "stream_logprobs over budget (P10)", stream

    def attention(backend):
        lay = Layout.group(P, [R] * G)
        with fc.fake_cuda():
            q = torch.randn(1, cfg.num_attention_heads, lay.num_tokens, cfg.head_dim, device=fc.DEVICE,
                            dtype=torch.bfloat16)
            k = torch.randn(1, cfg.num_key_value_heads, lay.num_tokens, cfg.head_dim, device=fc.DEVICE,
                            dtype=torch.bfloat16)
            out = flexgroup.attention(q, k, k, lay, backend=backend)
        _expect(out, torch.bfloat16, tuple(q.shape), f"attention {backend}")

    for backend in ("flex", "lse"):
        yield f"attention {backend} (P2, P5)", lambda b=backend: attention(b)

    from flexgroup.models.zoo import build_model, unavailable

    if not unavailable("qwen3_5_text"):
        hyb = lambda: build_model("qwen3_5_text", dtype=torch.float32)  # noqa: E731
        yield "hybrid tree lse", lambda: _model_case(hyb, tree_small(), "lse", hyb().config.vocab_size)


def tree_small() -> GroupedBatch:
    g = torch.Generator().manual_seed(3)
    a = torch.randint(3, 128, (40,), generator=g)
    return GroupedBatch.from_sequences([torch.cat([a, torch.randint(3, 128, (n,), generator=g)]) for n in (3, 9, 1)])


def run(cfg, P: int, R: int, G: int, build, log=print) -> dict:
    """Trace every case; ``{"ok", "cases": {name: "ok" | the error}}`` or ``{"skipped": why}``.

    ``build()`` returns a fresh float32 CPU model of ``cfg`` (it is moved to fake cuda in bf16 here).
    """
    why = fc.available()
    if why:
        log(f"fake-CUDA trace skipped: {why}")
        return {"skipped": why}
    cases = {}
    with fc.cuda_flex_without_inductor():
        for name, fn in _cases(cfg, P, R, G, build):
            try:
                fn()
                cases[name] = "ok"
            except Exception as e:  # noqa: BLE001 -- reported, and the check fails
                cases[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
    ok = all(v == "ok" for v in cases.values())
    log(f"fake-CUDA trace ({len(cases)} CUDA paths on fake cuda tensors, bf16): "
        + ("all ok" if ok else "FAILED: " + "; ".join(f"{k}: {v}" for k, v in cases.items() if v != "ok")))
    return {"ok": ok, "cases": cases}
