"""Ulysses sequence parallelism around a kernel: all-to-all from sequence shards to head shards and back.

A packed row of ``Lp`` tokens is split over the ``W`` ranks of a process group, ``c = Lp / W``
contiguous tokens each. Before attention (or a stateful mixer's scan), one all-to-all turns each
rank's ``[H, c, ...]`` (all heads, its tokens) into ``[H / W, Lp, ...]`` (its heads, every token): the
kernel then runs on the whole row for those heads with the same plan as a single process (masks
and virtual positions need no change), and a second all-to-all brings ``[H / W, Lp, ...]`` back to
``[H, c, ...]``. Both are differentiable: the backward of an all-to-all is the all-to-all with send
and receive counts swapped, so gradients reach the rank that computed each input.

Head shares: query heads (or a mixer's value / SSM heads) must divide by ``W``. Shared heads (GQA
key/value heads, Gated DeltaNet key heads, Mamba2 B/C groups) that do not divide by ``W`` are
replicated ``W / gcd(H_shared, W)`` times first (``repeat_interleave``, the copy GQA makes anyway):
exact, and autograd sums the copies' gradients. Channels of a depthwise convolution are independent
and may be split unevenly (:func:`even_counts`).

No transformers import here (kernels layer).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .base import Backend, Plan

__all__ = ["to_heads", "to_sequence", "even_counts", "replication", "attention"]

Tensor = torch.Tensor


class _AllToAll(torch.autograd.Function):
    """1-D ``all_to_all_single`` with ``send[j]`` elements to rank ``j`` and ``recv[j]`` from it."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = grad.new_empty(sum(ctx.send))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def even_counts(n: int, world: int) -> list[int]:
    """``n`` items split over ``world`` ranks as evenly as possible, in rank order."""
    return [n // world + (r < n % world) for r in range(world)]


def _common_dtype(parts: list[Tensor]) -> torch.dtype:
    dt = parts[0].dtype
    for p in parts[1:]:
        dt = torch.promote_types(dt, p.dtype)
    return dt  # every float widening used here (bf16/f16 -> f32 -> f64) round-trips exactly


def to_heads(parts: list[Tensor], counts: list[list[int]], group) -> list[Tensor]:
    """Sequence shards to head shards, several tensors in one all-to-all.

    Args:
        parts: per tensor ``i``, ``[H_i, c, R_i]``: every head, this rank's ``c`` tokens, the rest.
        counts: per tensor, ``W`` ints summing to ``H_i``: how many heads (in order) each rank gets.

    Returns:
        per tensor ``[counts[i][rank], W * c, R_i]``: this rank's heads over the whole row.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    c = parts[0].shape[1]
    dt = _common_dtype(parts)
    offs = [[0] + list(_cumsum(cnt)) for cnt in counts]
    send_chunks, send = [], []
    for j in range(world):
        n = 0
        for p, o in zip(parts, offs):
            blk = p[o[j]:o[j + 1]]
            send_chunks.append(blk.reshape(-1).to(dt))
            n += blk.numel()
        send.append(n)
    sizes = [cnt[rank] * c * p.shape[2] for p, cnt in zip(parts, counts)]   # per tensor, from each rank
    recv = [sum(sizes)] * world
    flat = _AllToAll.apply(torch.cat(send_chunks), send, recv, group)
    out = []
    blocks = [b.split(sizes) for b in flat.split(recv)]                      # [src rank][tensor]
    for i, (p, cnt) in enumerate(zip(parts, counts)):
        pieces = [blocks[j][i].view(cnt[rank], c, p.shape[2]) for j in range(world)]
        out.append(torch.cat(pieces, 1).to(p.dtype))                          # [h_i, W * c, R_i]
    return out


def to_sequence(parts: list[Tensor], counts: list[list[int]], group) -> list[Tensor]:
    """The inverse of :func:`to_heads`: per tensor ``[counts[i][rank], W * c, R_i]`` -> ``[H_i, c, R_i]``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    c = parts[0].shape[1] // world
    dt = _common_dtype(parts)
    send_chunks, send = [], []
    for j in range(world):
        blk = [p[:, j * c:(j + 1) * c].reshape(-1).to(dt) for p in parts]
        send_chunks += blk
        send.append(sum(b.numel() for b in blk))
    sizes = [[cnt[j] * c * p.shape[2] for p, cnt in zip(parts, counts)] for j in range(world)]  # [src][tensor]
    recv = [sum(s) for s in sizes]
    flat = _AllToAll.apply(torch.cat(send_chunks), send, recv, group)
    blocks = [b.split(s) for b, s in zip(flat.split(recv), sizes)]
    return [torch.cat([blocks[j][i].view(cnt[j], c, p.shape[2]) for j in range(world)], 0).to(p.dtype)
            for i, (p, cnt) in enumerate(zip(parts, counts))]


def _cumsum(xs: list[int]) -> list[int]:
    out, t = [], 0
    for x in xs:
        t += x
        out.append(t)
    return out


def replication(heads: int, shared: int, world: int, what: str) -> int:
    """How often to repeat each of ``shared`` heads so that ``heads`` and the copies split over ``world``.

    ``heads`` (query / value / SSM heads) must divide by ``world`` and by ``shared``; then
    ``f = world / gcd(shared, world)`` copies make ``shared * f`` divide both ``world`` and ``heads``
    and keep every head paired with its own shared head. ValueError naming the counts otherwise.
    """
    if heads % shared:
        raise ValueError(f"{what}: {heads} heads do not divide into {shared} shared heads; please report it")
    if heads % world:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"{what}: sequence parallelism over {world} ranks splits the {heads} heads across ranks, "
                         f"but {heads} is not divisible by {world}: use a sequence-parallel group whose size "
                         f"divides {heads} (one of {divisors})")
    return world // math.gcd(shared, world)


def attention(backend: Backend, plan: Plan, q: Tensor, k: Tensor, v: Tensor, scale: float, group,
              what: str = "attention") -> Tensor:
    """The backend's attention over the whole padded row, from this rank's sequence shard.

    Args:
        plan: the backend's plan of the whole padded layout (``Lp`` tokens).
        q: [1, Hq, c, D] this rank's tokens, RoPE applied. k/v: [1, Hkv, c, D].
        group: the sequence-parallel process group (``W`` ranks, ``Lp = W * c``).

    Returns:
        [1, Hq, c, D], this rank's tokens, every head.
    """
    world = dist.get_world_size(group)
    hq, hkv = q.shape[1], k.shape[1]
    f = replication(hq, hkv, world, f"{what} (query heads {hq}, key/value heads {hkv})")
    if f > 1:
        k, v = k.repeat_interleave(f, 1), v.repeat_interleave(f, 1)
    cq, ckv = even_counts(hq, world), even_counts(hkv * f, world)
    qh, kh, vh = to_heads([q[0], k[0], v[0]], [cq, ckv, ckv], group)   # [Hq/W, Lp, D], [Hkv'/W, Lp, D] x2
    out = backend.run(plan, qh[None], kh[None], vh[None], scale)      # [1, Hq/W, Lp, D]
    return to_sequence([out[0]], [cq], group)[0][None]
