"""Attention over a packed row: a tree's outputs (and its q/k/v gradients) depend on that tree alone (issue 43).

Tree A is attended alone, then packed after and before a tree of the same shapes and interleaved
segment by segment with it (its tokens then no contiguous range: the gathered paths of the plan and
of the key centring). Compared with ``torch.equal``: A's output rows, and the gradients of A's q, k,
v rows for a loss on A's outputs only. Segments over 16 tokens are cut into 8-token chunks (the lse
plan's chains); a window of 8 cuts some parts (masked parts).
"""

from __future__ import annotations

import pytest
import torch

from flexgroup import Layout, patterns
from flexgroup.kernels import attention, lse_plan

A = Layout.tree([-1, 0, 0, 1], [40, 12, 30, 9])
B = Layout.tree([-1, 0, 0, 1], [40, 12, 30, 9])


@pytest.fixture(autouse=True)
def short_chunks(monkeypatch):
    monkeypatch.setattr(lse_plan, "CHUNK", 8)


def _interleaved(a: Layout, b: Layout) -> tuple[Layout, torch.Tensor]:
    """Segments a0, b0, a1, b1, ...: the layout and the physical tokens of ``a`` in it ([a.num_tokens])."""
    parents, lengths, where, toks, start = [], [], {}, [], 0
    for s in range(max(a.num_segments, b.num_segments)):
        for name, lay in (("a", a), ("b", b)):
            if s < lay.num_segments:
                p = lay.parents[s]
                where[name, s] = len(parents)
                parents.append(-1 if p < 0 else where[name, p])
                lengths.append(lay.lengths[s])
                if name == "a":
                    toks.append(torch.arange(start, start + lay.lengths[s]))
                start += lay.lengths[s]
    return Layout.tree(parents, lengths), torch.cat(toks)


def _arrangements():
    n, m = A.num_tokens, B.num_tokens
    yield "alone", A, torch.arange(n)
    yield "after", Layout.pack([B, A]), torch.arange(m, m + n)
    yield "before", Layout.pack([A, B]), torch.arange(n)
    yield "interleaved", *_interleaved(A, B)


def _run(layout, rows, backend, dtype, pattern):
    g = torch.Generator().manual_seed(0)
    qa, ka, va = (torch.randn(1, h, A.num_tokens, 16, generator=g).to(dtype) for h in (4, 2, 2))
    w = torch.randn(1, 4, A.num_tokens, 16, generator=g).to(dtype)          # A's values first: the same everywhere
    other = [torch.randn(1, h, layout.num_tokens, 16, generator=g).to(dtype) for h in (4, 2, 2)]
    q, k, v = (o.index_copy(2, rows, x).requires_grad_() for o, x in zip(other, (qa, ka, va)))
    out = attention(q, k, v, layout, pattern=pattern, backend=backend)
    (out.index_select(2, rows).float() * w.float()).sum().backward()
    return [x.index_select(2, rows) for x in (out.detach(), q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("backend", ["lse", "sdpa"])
def test_a_trees_attention_and_its_qkv_gradients_do_not_depend_on_the_other_trees(backend, dtype, window):
    pattern = None if window is None else patterns.sliding_window(window)
    results = {name: _run(lay, rows, backend, dtype, pattern) for name, lay, rows in _arrangements()}
    alone = results.pop("alone")
    for name, got in results.items():
        for what, a, b in zip(("output", "dq", "dk", "dv"), alone, got):
            assert torch.equal(a, b), f"{what} {name}: max |diff| {(a.float() - b.float()).abs().max().item():.3g}"
