"""Ranks agree or stop together (DESIGN invariant 9): one fingerprint of what a sequence-parallel call
assumes equal on every rank of its group, compared before the call's first collective.

Every rank of a sequence-parallel group runs its slice of *one* computation: the all-to-alls, the log-prob
sums and the streaming schedule assume that every rank holds the same token ids, loss masks, temperature,
visual inputs, budget and layout. A rank that holds another batch (per-process image augmentation, another
sampling temperature, a loss mask built from rank-local data) would otherwise give silently wrong
numbers, or -- where the sizes of a collective differ -- abort (gloo: SIGABRT) or hang (NCCL).

:class:`Fingerprint` is a fixed-size digest, one int64 per field of :data:`FIELDS`; :func:`check_agreement`
all-gathers ``[rank, world, held, *digests]`` (``3 + len(FIELDS)`` int64 per rank, one collective) and raises the
same ValueError on every rank when any rank differs from rank 0 (the first rank that holds a fingerprint),
naming the fields and the ranks; a rank that refused its own arguments (``held`` 0) takes part too, so the
others raise, naming it, instead of waiting in a collective it never reaches. Who
checks: ``patch(model, sequence_parallel=group)``'s pre-hook on the language model, once per forward of
``batch.model_inputs(shard=group)`` / ``MultimodalGroupedBatch.model_inputs(shard=group)``
(:mod:`flexgroup.patches.sequence_parallel`); :func:`flexgroup.stream_backward` / ``stream_logprobs`` once per
call, before its first forward (:mod:`flexgroup.stream.shard`), whose streamed chunks are then not checked
again (the schedule is a function of what was checked).

Digests hash a tensor's dtype, shape and bytes (the first 8 bytes of a SHA-256; a tensor on an accelerator is
copied to the host once), so equal means bit-for-bit equal. Cost: ``benchmarks/rank_agreement.py``. No
transformers import here (data layer).
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Mapping

import torch

__all__ = ["FIELDS", "Fingerprint", "check_agreement"]

#: what every rank must hold equal, with the words an error uses for it
FIELDS = {
    "call": "call (a forward of model_inputs(shard=) / stream_backward / stream_logprobs, entropies asked for)",
    "layout": "layout (the packed row's segments, or the streaming schedule)",
    "input_ids": "token ids",
    "loss_masks": "loss masks",
    "temperature": "temperature",
    "visual": "visual inputs (pixel values' bytes, grids, video timing)",
    "budget": "budget (tokens per streamed forward)",
}
# fields whose slot holds the value itself (a float's bits, an int), so that an error can show it
_AS_FLOAT, _AS_INT = ("temperature",), ("budget",)


def _feed(h, value) -> None:
    """Feed ``value`` to the hash ``h`` unambiguously: a type tag, then the content."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            flat = t.reshape(-1).contiguous()
            if flat.dtype.is_complex:
                flat = torch.view_as_real(flat).reshape(-1)
            h.update(flat.view(torch.uint8).cpu().numpy().data)   # the bytes, whatever the dtype
    elif isinstance(value, Mapping):
        h.update(f"M{len(value)}".encode())
        for k in sorted(value, key=str):
            _feed(h, str(k))
            _feed(h, value[k])
    elif isinstance(value, (list, tuple)):
        h.update(f"L{len(value)}".encode())
        for v in value:
            _feed(h, v)
    elif isinstance(value, float):
        h.update(f"F{value.hex() if math.isfinite(value) else value}".encode())
    elif value is None or isinstance(value, (bool, int, str)):
        h.update(f"S{type(value).__name__}:{value}|".encode())
    else:
        raise TypeError(f"flexgroup: cannot fingerprint a {type(value).__name__} for the ranks' agreement check; "
                        "please report it")


def _digest(value) -> int:
    h = hashlib.sha256()   # SHA extensions: ~1.9 GB/s on one core, twice blake2b's speed here
    _feed(h, value)
    return int.from_bytes(h.digest()[:8], "little", signed=True)


@dataclass(frozen=True)
class Fingerprint:
    """One int64 per field of :data:`FIELDS`, in that order: a digest, or for a temperature (a float) / budget (an
    int) the value itself; a field a call does not have holds None's digest."""

    digests: tuple[int, ...]

    @classmethod
    def of(cls, **fields) -> "Fingerprint":
        """The fingerprint of ``fields`` (names from :data:`FIELDS`; values: tensors [any shape], numbers,
        strings, None, or lists / tuples / dicts of them)."""
        unknown = sorted(set(fields) - set(FIELDS))
        if unknown:
            raise TypeError(f"Fingerprint.of: unknown fields {unknown}; known: {list(FIELDS)}")
        return cls(tuple(_slot(name, fields.get(name)) for name in FIELDS))


def _slot(name: str, value) -> int:
    if value is not None and name in _AS_FLOAT:
        return struct.unpack("<q", struct.pack("<d", float(value)))[0]
    if value is not None and name in _AS_INT:
        return int(value)
    return _digest(value)


def _shown(name: str, slot: int) -> str:
    """`` (value)`` of a field whose slot holds its value (see :data:`_AS_FLOAT`), else nothing."""
    if name in _AS_FLOAT and slot != _digest(None):
        return f" {struct.unpack('<d', struct.pack('<q', slot))[0]!r}"
    if name in _AS_INT and slot != _digest(None):
        return f" {slot}"
    return ""


def _collective_device(group, device) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl" and torch.device(device).type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def check_agreement(fingerprint: Fingerprint | None, group, rank: int, world: int, device, who: str) -> None:
    """All-gather ``fingerprint`` over ``group`` (one collective of ``W x (3 + len(FIELDS))`` int64); ValueError,
    the same on every rank, if any rank differs from the first rank that holds a fingerprint, holds inputs built
    for another rank / group size, or refused its own arguments.

    Args:
        fingerprint: this rank's :class:`Fingerprint`; None: this rank refused its own arguments and raises its
            own error after this call (which then returns without raising), while the others raise naming it.
        group: the ``torch.distributed`` process group; ``rank``, ``world``: this process's rank in it and the
            group size the inputs were built for.
        device: where the gathered tensor lives (a CUDA device for NCCL; moved there if not).
        who: the call, for the message (e.g. ``"flexgroup.stream_backward"``).
    """
    import torch.distributed as dist

    dev = _collective_device(group, device)
    digests = fingerprint.digests if fingerprint is not None else (0,) * len(FIELDS)
    mine = torch.tensor([rank, world, fingerprint is not None, *digests], dtype=torch.int64, device=dev)
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, mine, group=group)
    rows = [g.tolist() for g in got]
    if fingerprint is None:
        return
    names = list(FIELDS)
    ref = next(r for r, row in enumerate(rows) if row[2])   # this rank holds one: there is a first
    problems = []
    for r, row in enumerate(rows):
        if not row[2]:
            problems.append(f"rank {r} refused its own arguments (its error says why)")
        elif row[0] != r or row[1] != len(rows):
            problems.append(f"rank {r} holds inputs built for rank {row[0]} of a group of {row[1]} (its shard was "
                            "made on another rank or for another group)")
        elif differ := [i for i in range(len(names)) if row[3 + i] != rows[ref][3 + i]]:
            what = ", ".join(f"{FIELDS[names[i]]}{_shown(names[i], row[3 + i])}" for i in differ)
            was = ", ".join(f"{names[i]}{_shown(names[i], rows[ref][3 + i])}" for i in differ)
            problems.append(f"rank {r} holds other {what} than rank {ref} ({was}; "
                            f"field{'s' if len(differ) > 1 else ''} {', '.join(names[i] for i in differ)})")
    if problems:
        raise ValueError(
            f"{who}: the ranks of the sequence-parallel group disagree, so nothing was run (no collective of the "
            f"call started): {'; '.join(problems)}. Under sequence parallelism every rank computes a slice of one "
            "batch: call with the same sequences, loss masks, temperature, visual inputs and budget on every rank "
            "of the group (random image augmentation seeded the same on each rank of a group; data loaders that "
            "give each rank of a group the same samples)")
