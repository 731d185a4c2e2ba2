"""Trainer tensors -> per-sequence token ids and loss masks (what :class:`~flexgroup.data.batch.GroupedBatch` packs).

Trainers hand over right- or left-padded ``[N, L]`` tensors; these functions check them (shapes,
dtypes, padding sides, empty rows, groups that mix prompts) with errors that name the row and the
fix, and cut them into the 1-D pieces the packers take:

- :func:`check_padded`: TRL / verl prompt + completion tensors, checked;
- :func:`group_rows`: their groups (``group_size`` / ``group_ids``) as one prompt and its responses;
- :func:`trie_rows`: their rows as whole sequences (``share="trie"``);
- :func:`sequence_rows`: whole right-padded sequences (multi-turn trainers) with their loss masks.

No transformers import here (data layer).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..layout.checks import bool_mask
from ..layout.checks import loss_mask as _checked_loss_mask

__all__ = ["check_padded", "group_rows", "trie_rows", "sequence_rows"]

Tensor = torch.Tensor


def check_padded(prompt_ids, prompt_mask, completion_ids, completion_mask
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(prompt_ids, prompt_mask, completion_ids, completion_mask)`` on CPU, masks as bool, checked.

    Prompts left-padded ``[N, Lp]``, completions right-padded ``[N, Lc]`` (mask 1 on real tokens).
    """
    pid, pm, cid, cm = (torch.as_tensor(t) for t in (prompt_ids, prompt_mask, completion_ids, completion_mask))
    for name, t in (("prompt_ids", pid), ("prompt_mask", pm), ("completion_ids", cid), ("completion_mask", cm)):
        if t.ndim != 2:
            raise ValueError(f"from_padded: {name} must be 2-D [N, len], got shape {tuple(t.shape)}")
    n = pid.shape[0]
    if n == 0:
        raise ValueError("from_padded: got 0 rows (prompt_ids has shape "
                         f"{tuple(pid.shape)}): give at least one prompt / completion row")
    for name, t in (("prompt_ids", pid), ("completion_ids", cid)):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"from_padded: {name} has dtype {t.dtype}; token ids must be an integer tensor "
                             "(a float id such as 3.7 would be truncated silently)")
    if pm.shape != pid.shape or cm.shape != cid.shape or cid.shape[0] != n:
        raise ValueError(f"from_padded: shapes disagree: prompt_ids {tuple(pid.shape)}, prompt_mask "
                         f"{tuple(pm.shape)}, completion_ids {tuple(cid.shape)}, completion_mask {tuple(cm.shape)}")
    pid, cid = pid.cpu(), cid.cpu()
    pm, cm = bool_mask(pm, "from_padded: prompt_mask"), bool_mask(cm, "from_padded: completion_mask")
    if (pm[:, 1:] < pm[:, :-1]).any():
        bad = int(torch.nonzero((pm[:, 1:] < pm[:, :-1]).any(1))[0])
        raise ValueError(f"from_padded: prompt_mask row {bad} is not left-padded (a 0 after a 1)")
    if (cm[:, 1:] > cm[:, :-1]).any():
        bad = int(torch.nonzero((cm[:, 1:] > cm[:, :-1]).any(1))[0])
        raise ValueError(f"from_padded: completion_mask row {bad} is not right-padded (a 1 after a 0)")
    return pid, pm, cid, cm


def trie_rows(pid: Tensor, pm: Tensor, cid: Tensor, cm: Tensor) -> tuple[list[Tensor], list[Tensor], list[int]]:
    """Checked padded tensors -> (whole sequences ``[prompt; completion]``, loss masks on the completions,
    prompt lengths)."""
    n = pid.shape[0]
    plen, clen = pm.sum(1), cm.sum(1)
    for i in range(n):
        if plen[i] == 0 or clen[i] == 0:
            raise ValueError(f"from_padded: the {'prompt' if plen[i] == 0 else 'completion'} of row {i} is empty")
    seqs = [torch.cat([pid[i][pm[i]], cid[i][cm[i]]]).long() for i in range(n)]
    return seqs, [torch.arange(len(s)) >= int(plen[i]) for i, s in enumerate(seqs)], plen.tolist()


def group_rows(pid: Tensor, pm: Tensor, cid: Tensor, cm: Tensor, group_size: int | None,
               group_ids: Sequence | Tensor | None) -> tuple[list[Tensor], list[list[Tensor]], list[int]]:
    """Checked padded tensors -> (one prompt per group, its responses, the output row of each packed response).

    Groups are consecutive rows of ``group_size``, or rows with equal ``group_ids`` (in order of first
    appearance); members must have identical prompt tokens.
    """
    n = pid.shape[0]
    plen, clen = pm.sum(1), cm.sum(1)
    if group_ids is not None:
        ids = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
        if len(ids) != n:
            raise ValueError(f"from_padded: group_ids has {len(ids)} entries for {n} rows")
        members: dict = {}
        for i, g in enumerate(ids):
            members.setdefault(g, []).append(i)
        groups = list(members.items())
    elif group_size is not None:
        if isinstance(group_size, bool) or int(group_size) < 1 or n % int(group_size):
            raise ValueError(f"from_padded: group_size={group_size!r} must be a positive divisor of the "
                             f"{n} rows")
        G = int(group_size)
        groups = [(g, list(range(g * G, (g + 1) * G))) for g in range(n // G)]
    else:
        raise ValueError("from_padded: give group_size (consecutive groups) or group_ids (or share='trie')")
    prompts, responses, order = [], [], []
    for g, rows in groups:
        first = rows[0]
        if plen[first] == 0:
            raise ValueError(f"from_padded: the prompt of row {first} (group {g!r}) is empty")
        p = pid[first, pid.shape[1] - int(plen[first]):]
        for i in rows[1:]:
            q = pid[i, pid.shape[1] - int(plen[i]):]
            if q.shape != p.shape or not torch.equal(q, p):
                raise ValueError(
                    f"from_padded: group {g!r} mixes different prompts (rows {first} and {i} differ): "
                    "members of a group must have identical prompt tokens; check group_size/group_ids")
        rs = []
        for i in rows:
            if clen[i] == 0:
                raise ValueError(f"from_padded: completion of row {i} (group {g!r}) is empty (response index {i})")
            rs.append(cid[i, : int(clen[i])].long())
        prompts.append(p.long())
        responses.append(rs)
        order += rows
    return prompts, responses, order


def sequence_rows(input_ids, attention_mask=None, loss_mask=None, completion_mask=None, tool_mask=None
                  ) -> tuple[list[Tensor], list[Tensor], int]:
    """Whole right-padded sequences ``[N, L]`` -> (N sequences, N checked loss masks, ``L``).

    See :meth:`flexgroup.GroupedBatch.from_padded_sequences` for the arguments.
    """
    ids = torch.as_tensor(input_ids)
    if ids.ndim != 2 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"from_padded_sequences: input_ids must be a 2-D integer tensor [N, L], got shape "
                         f"{tuple(ids.shape)} dtype {ids.dtype}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"from_padded_sequences: input_ids of shape {tuple(ids.shape)} holds no sequence")

    def mask2d(m, name):
        m = torch.as_tensor(m)
        if m.shape != ids.shape:
            raise ValueError(f"from_padded_sequences: {name} has shape {tuple(m.shape)}, input_ids "
                             f"{tuple(ids.shape)}: give one entry per token, aligned with input_ids")
        return bool_mask(m, f"from_padded_sequences: {name}")

    am = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else mask2d(attention_mask, "attention_mask")
    if (am[:, 1:] > am[:, :-1]).any():
        bad = int(torch.nonzero((am[:, 1:] > am[:, :-1]).any(1))[0])
        raise ValueError(f"from_padded_sequences: attention_mask row {bad} is not right-padded (a 1 after a 0); "
                         "for left-padded prompts with separate completions use from_padded")
    if loss_mask is not None and (completion_mask is not None or tool_mask is not None):
        raise ValueError("from_padded_sequences: give loss_mask or completion_mask (+ tool_mask), not both")
    if loss_mask is None and completion_mask is None and tool_mask is not None:
        raise ValueError("from_padded_sequences: tool_mask needs completion_mask (TRL's loss mask is "
                         "completion_mask * tool_mask)")
    if loss_mask is not None:
        lm = mask2d(loss_mask, "loss_mask")
    elif completion_mask is not None:
        lm = mask2d(completion_mask, "completion_mask")
        if tool_mask is not None:
            lm = lm & mask2d(tool_mask, "tool_mask")
    else:
        lm = am.clone()
        lm[:, 0] = False
    if (lm & ~am).any():
        bad = int(torch.nonzero((lm & ~am).any(1))[0])
        raise ValueError(f"from_padded_sequences: the loss mask of row {bad} is True on padding "
                         "(attention_mask 0)")
    n_real = am.sum(1).tolist()
    if 0 in n_real:
        raise ValueError(f"from_padded_sequences: row {n_real.index(0)} has no real token (attention_mask all 0)")
    seqs = [ids[i, :n].cpu() for i, n in enumerate(n_real)]
    masks = [lm[i, :n] for i, n in enumerate(n_real)]
    masks = [_checked_loss_mask(m, s.numel(), f"from_padded_sequences: the loss mask of row {i}")
             for i, (m, s) in enumerate(zip(masks, seqs))]
    return seqs, masks, ids.shape[1]
