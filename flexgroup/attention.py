"""One attention entry point over a :class:`~flexgroup.layout.Layout`, with exact backends.

Backends:

- ``"flex"``: a process-wide ``torch.compile``'d ``flex_attention`` with the layout's analytic
  BlockMask (cached on the layout, so every layer of a forward reuses it). GQA through
  ``enable_gqa`` (no K/V repeat). Forward and backward on CUDA; forward only on CPU (FlexAttention
  has no CPU backward, so a CPU call that needs a gradient is refused). The compiled CPU kernel has
  returned wrong numbers silently in our tests (torch 2.13 at some lengths, torch 2.6 with some
  block tables), so on CPU each new kernel configuration is first checked against eager flex on a
  fixed hard layout, and refused with an error if it disagrees.
- ``"flex_eager"``: the same without torch.compile (slow, materialises scores; for tests and debugging).
- ``"sdpa"``: exact on any device, forward and backward. Per segment, queries attend to the keys of
  their ancestor segments plus their own keys causally, so only allowed pairs are computed -- never
  a dense ``L x L`` mask, which would compute every masked pair (FIELD-NOTES: slower than the
  baseline when responses are long). A root segment with no pattern uses the causal kernel
  (``is_causal=True``). With a score_mod the same per-segment split runs as explicit math.
- ``"auto"``: ``flex`` on CUDA, ``sdpa`` on CPU (exact, no compile; see the note on ``flex``).
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from .layout import Layout
from .patterns import ScoreMod, from_callable, score_mod as as_score_mod

__all__ = ["attention", "BACKENDS"]

BACKENDS = ("auto", "flex", "flex_eager", "sdpa")
_COMPILED_FLEX: dict[str, Callable] = {}


def compiled_flex_attention(device_type: str = "cuda") -> Callable:
    """The process-wide compiled ``flex_attention`` for a device type (compiled once, then shared).

    On CUDA it uses torch.compile's automatic dynamic shapes: the first new length recompiles once,
    later lengths reuse the dynamic kernel. On CPU the kernel is compiled static (one compile per
    distinct row length): torch 2.13's CPU inductor generates C++ that does not compile for a dynamic
    flex kernel in some mask/score_mod combinations (``cur_qSplitSize`` undeclared). Past dynamo's
    recompile limit it falls back to eager flex -- slower, still exact.
    """
    if device_type not in _COMPILED_FLEX:
        dynamic = None if device_type == "cuda" else False
        _COMPILED_FLEX[device_type] = torch.compile(flex_attention, dynamic=dynamic)
    return _COMPILED_FLEX[device_type]


def _needs_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def resolve_backend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The concrete backend ``attention`` will use for these inputs (``auto`` resolved)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose one of {BACKENDS}")
    if backend == "auto":
        return "flex" if q.device.type == "cuda" else "sdpa"
    if backend in ("flex", "flex_eager") and q.device.type == "cpu" and _needs_grad(q, k, v):
        raise NotImplementedError(
            f"backend={backend!r} cannot train on CPU: FlexAttention has no backward pass on CPU. "
            "Use backend='sdpa' (exact, differentiable) or 'auto', or run under torch.no_grad()."
        )
    return backend


def _check_inputs(q, k, v, layout):
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a flexgroup.Layout, got {type(layout).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4 or t.shape[0] != 1:
            raise ValueError(f"{name} must have shape [1, H, L, D] (one packed row), got {tuple(t.shape)}")
        if t.shape[2] != layout.num_tokens:
            raise ValueError(
                f"{name} has {t.shape[2]} tokens but the layout has {layout.num_tokens}: "
                "build the layout for exactly this packed row"
            )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head_dim of q ({q.shape[3]}) and k ({k.shape[3]}) differ")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"GQA needs Hq % Hkv == 0, got Hq={q.shape[1]}, Hkv={k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, *,
              pattern: Callable | None = None, score_mod: Callable | None = None,
              scale: float | None = None, backend: str = "auto", block_size: int = 128) -> torch.Tensor:
    """Exact attention over a packed row described by ``layout``.

    Every query token attends to the tokens of its own root-to-leaf sequence, causally -- the same
    context it would have if that sequence were run alone -- further restricted by ``pattern``.

    Args:
        q: [1, Hq, L, D] queries (RoPE already applied with virtual positions).
        k: [1, Hkv, L, D] keys, ``Hq % Hkv == 0`` (grouped-query attention).
        v: [1, Hkv, L, D] values.
        layout: the row's :class:`Layout`, ``layout.num_tokens == L``.
        pattern: optional ``(q_pos, kv_pos) -> BoolTensor`` on virtual positions
            (see :mod:`flexgroup.patterns`).
        score_mod: optional ``(score, b, h, q_pos, kv_pos) -> score`` on virtual positions.
        scale: softmax scale; default ``1 / sqrt(D)``.
        backend: ``"auto"``, ``"flex"``, ``"flex_eager"`` or ``"sdpa"`` (see module docstring).
        block_size: BlockMask block size for the flex backends (the compiled CPU kernel always
            uses 128, the only size it computes correctly on every torch version tested).

    Returns:
        [1, Hq, L, D] in the dtype of ``q``.
    """
    _check_inputs(q, k, v, layout)
    pat = from_callable(pattern) if pattern is not None else None
    smod = as_score_mod(score_mod) if score_mod is not None else None
    if smod is not None:
        smod.check_heads(q.shape[1])
        smod = smod.to(q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    which = resolve_backend(backend, q, k, v)
    if which == "sdpa":
        return _sdpa_attention(q, k, v, layout, pat, smod, scale)
    return _flex_attention(q, k, v, layout, pat, smod, scale, compiled=(which == "flex"),
                           block_size=block_size)


# ------------------------------------------------------------------------------------ flex
def _padded_layout(layout: Layout, multiple: int) -> tuple[Layout, int]:
    """``layout`` plus a separate padding tree up to a multiple of ``multiple`` tokens (cached).

    Padding tokens form their own root segment: real tokens never attend to them, and each padding
    row attends to earlier padding tokens only, so it is never empty.
    """
    pad = -layout.num_tokens % multiple
    if pad == 0:
        return layout, 0
    key = ("padded", multiple)
    if key not in layout._cache:
        layout._cache[key] = Layout.pack([layout, Layout.tree([-1], [pad])])
    return layout._cache[key], pad


_BLOCK_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _mark_lengths_dynamic(q, k, v, bm) -> None:
    # Declare the row length and the block-table sizes dynamic up front, so that a second length
    # does not compile a static kernel first (measured with automatic dynamic shapes: 3 compiles
    # for 20 varying lengths without these marks, 2 with them).
    for t in (q, k, v):
        torch._dynamo.maybe_mark_dynamic(t, 2)
    for name in _BLOCK_TABLES:
        t = getattr(bm, name, None)
        if t is not None:
            for d in range(2, t.ndim):
                torch._dynamo.maybe_mark_dynamic(t, d)


_CPU_KERNEL_OK: dict = {}


def _hashable(x):
    try:
        hash(x)
        return x
    except TypeError:
        return id(x)


def _check_cpu_kernel(q, k, pat, smod, scale) -> None:
    """Refuse a compiled CPU flex configuration that disagrees with eager flex on a hard layout.

    Runs once per (dtype, heads, head_dim, pattern, score_mod, scale): a 166-token forest with
    groups, a deeper tree and an interleaved forest (empty, partial and full 128-blocks, padded
    rows), through the same compiled path, compared with eager flex (which computes every score).
    """
    key = (q.dtype, q.shape[1], k.shape[1], q.shape[3], _hashable(pat), _hashable(smod), scale)
    if key not in _CPU_KERNEL_OK:
        _CPU_KERNEL_OK[key] = None  # a recursive call below must not check again
        lay = Layout.pack([Layout.group(40, [17, 30, 9]), Layout.tree([-1, -1, 0, 1, 2, 1, 3], [9, 4, 6, 3, 2, 5, 1]),
                           Layout.tree([-1, 0, 0], [20, 5, 6])])
        g = torch.Generator().manual_seed(0)
        L, D = lay.num_tokens, q.shape[3]
        qq = torch.randn(1, q.shape[1], L, D, generator=g).to(q.dtype)
        kk, vv = (torch.randn(1, k.shape[1], L, D, generator=g).to(q.dtype) for _ in range(2))
        with torch.no_grad():
            got = _flex_attention(qq, kk, vv, lay, pat, smod, scale, compiled=True, block_size=128)
            want = _flex_attention(qq, kk, vv, lay, pat, smod, scale, compiled=False, block_size=128)
        err = float((got.float() - want.float()).abs().max())
        tol = 1e-4 if q.dtype in (torch.float32, torch.float64) else 5e-2
        _CPU_KERNEL_OK[key] = (err <= tol, err)
    ok = _CPU_KERNEL_OK[key]
    if ok is not None and not ok[0]:
        raise NotImplementedError(
            f"backend='flex' on CPU: this torch build's compiled FlexAttention kernel returned wrong "
            f"numbers in flexgroup's self-check (max error {ok[1]:.3g} against eager flex for dtype "
            f"{q.dtype}, {q.shape[1]}/{k.shape[1]} heads, head_dim {q.shape[3]}). Use backend='sdpa' "
            "(exact) or 'flex_eager' on CPU."
        )


def _on_virtual_positions(smod: ScoreMod, pos: torch.Tensor) -> Callable:
    """A FlexAttention score_mod on physical indices that calls ``smod`` on virtual positions."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return smod(score, b, h, pos[q_idx], pos[kv_idx])

    return score_mod


def _flex_attention(q, k, v, layout, pat, smod, scale, *, compiled, block_size):
    L, pad = layout.num_tokens, 0
    if compiled and q.device.type == "cpu":
        # The compiled CPU flex kernel returns wrong numbers, silently, for some row lengths
        # (torch 2.13: L = 8, 24, 40 measured; 128, 256, 384 exact) and for blocks other than 128
        # (torch 2.6: error ~2 with block_size=16). Only the block *tables* depend on the block
        # size -- the mask_mod is exact -- so the CPU kernel always gets 128-token blocks on a row
        # padded to a multiple of 128 (tests/test_attention.py checks L=24 and block_size=16).
        block_size = 128
        layout, pad = _padded_layout(layout, block_size)
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    bm = layout.block_mask(pat, device=q.device, block_size=block_size)
    sm = None if smod is None else _on_virtual_positions(smod, layout.token_tensors(q.device)["pos"])
    gqa = q.shape[1] != k.shape[1]
    if compiled:
        if q.device.type != "cpu":
            _mark_lengths_dynamic(q, k, v, bm)
        else:
            _check_cpu_kernel(q, k, pat, smod, scale)
        out = compiled_flex_attention(q.device.type)(q, k, v, score_mod=sm, block_mask=bm, scale=scale,
                                                     enable_gqa=gqa)
        return out[:, :, :L] if pad else out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is slow; that is its purpose here
        return flex_attention(q, k, v, score_mod=sm, block_mask=bm, scale=scale, enable_gqa=gqa)


# ------------------------------------------------------------------------------------ sdpa
def _key_index(layout: Layout, s: int) -> slice | list[range]:
    """Token ranges a segment's queries read: its ancestors root-first, then itself."""
    segs = layout.ancestors[s] + (s,)
    ranges = [layout.segment_range(a) for a in segs]
    if all(r0.stop == r1.start for r0, r1 in zip(ranges, ranges[1:])):
        return slice(ranges[0].start, ranges[-1].stop)  # contiguous: a view, no copy
    return ranges


def _gather(x: torch.Tensor, idx) -> torch.Tensor:
    if isinstance(idx, slice):
        return x[:, :, idx]
    return torch.cat([x[:, :, r.start:r.stop] for r in idx], dim=2)


def _sibling_batches(layout: Layout, min_fill: float = 0.75) -> list[tuple[int, ...]]:
    """Groups of >= 2 sibling segments (same ancestors) to attend in one padded kernel call (cached).

    Siblings are sorted by length and cut greedily so that real tokens fill at least ``min_fill``
    of each padded batch: one call instead of G saves the per-call overhead that dominates short
    responses, while the padding never costs more than a third extra.
    """
    key = ("sibling_batches", min_fill)
    if key not in layout._cache:
        by_anc: dict[tuple, list[int]] = {}
        for s, anc in enumerate(layout.ancestors):
            if anc:
                by_anc.setdefault(anc, []).append(s)
        batches = []
        for segs in by_anc.values():
            segs = sorted(segs, key=lambda x: -layout.lengths[x])
            cur: list[int] = []
            for x in segs:
                n_max = layout.lengths[cur[0]] if cur else layout.lengths[x]
                total = sum(layout.lengths[y] for y in cur) + layout.lengths[x]
                if cur and total < min_fill * n_max * (len(cur) + 1):
                    batches.append(tuple(cur))
                    cur = []
                cur.append(x)
            batches.append(tuple(cur))
        layout._cache[key] = [b for b in batches if len(b) >= 2]
    return layout._cache[key]


def _sdpa_plan(layout: Layout, pat, device: torch.device, batch_siblings: bool) -> list[tuple]:
    """Per-forward-invariant work of the sdpa backend, built once per (layout, pattern, device).

    Every layer of a forward (and the backward) reuses the same masks, key index ranges and
    positions, so they are cached on the layout like the flex BlockMask; the hot path then makes no
    host syncs. Steps, in any order (outputs are placed by segment):

    - ``("siblings", segs, lens, anc, mask [G, 1, n_max, a + n_max], live [G, n_max])``: sibling
      segments in one padded call; dead rows (padding, or no allowed key) read key 0, then are zeroed;
    - ``("segment", s, idx, mask [n, m] | None, live [n] | None, q_pos, kv_pos)``: one segment;
      ``mask None`` means plain causal (a root without pattern), ``live None`` means every row has a key.
    """
    key = ("sdpa_plan", _hashable(pat), str(device), batch_siblings)
    if key in layout._cache:
        return layout._cache[key]
    pos = layout.token_tensors(device)["pos"]
    p = pat.to_device(device) if pat is not None else None
    steps, done = [], set()
    for segs in (_sibling_batches(layout) if batch_siblings else []):
        lens = [layout.lengths[x] for x in segs]
        n_max, G = max(lens), len(segs)
        anc = [layout.segment_range(a) for a in layout.ancestors[segs[0]]]
        a = sum(len(r) for r in anc)
        rows = torch.arange(n_max, device=device)
        real_q = rows[None, :] < torch.tensor(lens, device=device)[:, None]            # [G, n_max]
        own = torch.ones(n_max, n_max, dtype=torch.bool, device=device).tril()[None] & real_q[:, None, :]
        mask = torch.cat([torch.ones(G, n_max, a, dtype=torch.bool, device=device), own], dim=2)
        if p is not None:
            anc_pos = _gather(pos.view(1, 1, -1), anc).view(-1)
            own_pos = torch.stack([pos[layout.starts[x]] + rows for x in segs])        # [G, n_max]
            kv_pos = torch.cat([anc_pos.expand(G, -1), own_pos], dim=1)                # [G, a + n_max]
            mask = mask & p(own_pos[:, :, None], kv_pos[:, None, :])
        live = mask.any(-1) & real_q
        mask = mask.clone()
        mask[..., 0] |= ~live  # dead rows read key 0 (never an empty softmax), then are zeroed
        steps.append(("siblings", segs, lens, anc, mask[:, None], live))
        done.update(segs)
    for x in range(layout.num_segments):
        if x in done:
            continue
        st, n = layout.starts[x], layout.lengths[x]
        idx = _key_index(layout, x)
        q_pos = pos[st:st + n]
        kv_pos = _gather(pos.view(1, 1, -1), idx).view(-1)
        m = kv_pos.numel()
        a = m - n  # ancestor tokens, all visible before the pattern
        if a == 0 and p is None:
            steps.append(("segment", x, idx, None, None, q_pos, kv_pos))
            continue
        mask = torch.ones(n, m, dtype=torch.bool, device=device)
        mask[:, a:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        if p is not None:
            mask = mask & p(q_pos[:, None], kv_pos[None, :])
        live = mask.any(-1)
        if bool(live.all()):  # once per plan, not per layer
            live = None
        else:  # rows with no allowed key return 0, as FlexAttention does: read own key, then zero
            mask = mask | (~live[:, None] & (torch.arange(m, device=device) == a + torch.arange(n, device=device)[:, None]))
        steps.append(("segment", x, idx, mask, live, q_pos, kv_pos))
    layout._cache[key] = steps
    return steps


def _sdpa_attention(q, k, v, layout, pat, smod, scale):
    gqa = q.shape[1] != k.shape[1]
    out: dict[int, torch.Tensor] = {}
    for step in _sdpa_plan(layout, pat, q.device, batch_siblings=smod is None):
        if step[0] == "siblings":
            _, segs, lens, anc, mask, live = step
            n_max, G = max(lens), len(segs)

            def pad(x, s):  # [1, H, n_s, D] -> [1, H, n_max, D]
                st, n = layout.starts[s], layout.lengths[s]
                return F.pad(x[:, :, st:st + n], (0, 0, 0, n_max - n))

            qb = torch.cat([pad(q, s) for s in segs])                                  # [G, Hq, n_max, D]
            kb = torch.cat([_gather(k, anc).expand(G, -1, -1, -1), torch.cat([pad(k, s) for s in segs])], dim=2)
            vb = torch.cat([_gather(v, anc).expand(G, -1, -1, -1), torch.cat([pad(v, s) for s in segs])], dim=2)
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=gqa)
            o = o * live[:, None, :, None].to(o.dtype)
            out.update({s: o[i:i + 1, :, :n] for i, (s, n) in enumerate(zip(segs, lens))})
            continue
        _, s, idx, mask, live, q_pos, kv_pos = step
        st, n = layout.starts[s], layout.lengths[s]
        qs, ks, vs = q[:, :, st:st + n], _gather(k, idx), _gather(v, idx)
        if smod is not None:
            if mask is None:
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            o = _math_attention(qs, ks, vs, mask, smod, scale, q_pos, kv_pos)
        elif mask is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[s] = o if live is None else o * live.to(o.dtype)[:, None]
    return torch.cat([out[s] for s in range(layout.num_segments)], dim=2)


def _math_attention(q, k, v, mask, smod: ScoreMod, scale, q_pos, kv_pos):
    """Explicit attention with a score_mod: q [1,Hq,n,D], k/v [1,Hkv,m,D], mask [n,m] -> [1,Hq,n,D]."""
    _, hq, n, d = q.shape
    hkv, m = k.shape[1], k.shape[2]
    g = hq // hkv
    q5 = q.view(1, hkv, g, n, d)
    scores = torch.matmul(q5, k[:, :, None].transpose(-1, -2)) * scale  # [1, Hkv, g, n, m]
    h = torch.arange(hq, device=q.device).view(1, hkv, g, 1, 1)  # head i uses kv head i // g
    b = torch.zeros(1, 1, 1, 1, 1, dtype=torch.long, device=q.device)
    scores = smod(scores, b, h, q_pos.view(n, 1), kv_pos.view(1, m))
    scores = scores.masked_fill(~mask, float("-inf"))
    # softmax in at least float32, as transformers' eager attention does
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return torch.matmul(probs, v[:, :, None]).reshape(1, hq, n, d)
