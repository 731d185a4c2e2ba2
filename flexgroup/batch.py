"""GroupedBatch: user tensors <-> one packed model row, and per-response log-probs back.

Several groups (one prompt, G responses each) pack into one row ``[P1; R11; ...; P2; R21; ...]``
described by ``Layout.pack([Layout.group(...), ...])``. The patched model reads the layout from
the ``attention_mask`` given by :meth:`GroupedBatch.model_inputs` (see :mod:`flexgroup.hf`).

No transformers import here.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .layout import Layout

__all__ = ["GroupedBatch"]

Tensor = torch.Tensor


def _ids(x, what: str) -> Tensor:
    x = torch.as_tensor(x)
    if x.ndim != 1 or x.is_floating_point() or x.dtype == torch.bool:
        raise ValueError(f"{what} must be a 1-D integer tensor of token ids, got shape {tuple(x.shape)} "
                         f"dtype {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"{what} is empty: prompts and responses need at least one token")
    return x.long().cpu()


class GroupedBatch:
    """Groups of (prompt, responses) packed into one row, with the metadata to read log-probs back.

    Build with :meth:`from_groups` or :meth:`from_padded`.

    Attributes:
        layout: the packed :class:`Layout` (one two-level tree per group).
        input_ids: LongTensor [L], the packed row.
        num_responses: N, responses in input order.
        response_lengths: list[int] of length N.
        response_mask: BoolTensor [N, max_len], True on real response tokens.
        group_of_response: LongTensor [N], group index of each response.
    """

    def __init__(self, prompts: list[Tensor], responses: list[list[Tensor]], order: Sequence[int] | None = None,
                 width: int | None = None):
        # responses[g] are listed in packing order; ``order[k]`` is the output row of the k-th packed response
        layouts, pieces = [], []
        for g, (p, rs) in enumerate(zip(prompts, responses)):
            layouts.append(Layout.group(p.numel(), [r.numel() for r in rs]))
            pieces += [p] + list(rs)
        self.layout: Layout = Layout.pack(layouts)
        self.input_ids: Tensor = torch.cat(pieces)
        lay = self.layout
        lens, pred_first, starts, groups = [], [], [], []
        seg = 0
        for g, rs in enumerate(responses):
            last_prompt = lay.starts[seg] + lay.lengths[seg] - 1  # predicts every response's first token
            for j in range(len(rs)):
                s = seg + 1 + j
                lens.append(lay.lengths[s])
                starts.append(lay.starts[s])
                pred_first.append(last_prompt)
                groups.append(g)
            seg += 1 + len(rs)
        n = len(lens)
        order = list(range(n)) if order is None else list(order)
        self.num_responses: int = n
        self.max_len: int = max(lens) if width is None else int(width)
        self.response_lengths: list[int] = [0] * n
        lens_t = torch.tensor(lens)
        starts_t = torch.tensor(starts)
        rows_t = torch.tensor(order)
        for k, o in enumerate(order):
            self.response_lengths[o] = lens[k]
        self.group_of_response = torch.empty(n, dtype=torch.long)
        self.group_of_response[rows_t] = torch.tensor(groups)
        # per response token (packing order): which logit row predicts it, the token, where it goes
        resp_seg = torch.repeat_interleave(torch.arange(n), lens_t)                   # [T]
        t_in = torch.arange(int(lens_t.sum())) - torch.repeat_interleave(lens_t.cumsum(0) - lens_t, lens_t)
        tok_pos = starts_t[resp_seg] + t_in                                           # physical index [T]
        pred = torch.where(t_in == 0, torch.tensor(pred_first)[resp_seg], tok_pos - 1)
        self._pred_idx = pred                                   # [T] logit row predicting each token
        self._targets = self.input_ids[tok_pos]                 # [T] the token
        self._flat_out = rows_t[resp_seg] * self.max_len + t_in  # [T] index into [N * max_len]
        mask = torch.zeros(n * self.max_len, dtype=torch.bool)
        mask[self._flat_out] = True
        self.response_mask: Tensor = mask.view(n, self.max_len)
        # the logit rows log-probs read (last prompt positions and response tokens but the last),
        # and where each predicted token's row sits among them
        self.logit_rows: Tensor = torch.unique(pred)                 # [K] sorted physical indices
        self._pred_in_rows = torch.searchsorted(self.logit_rows, pred)  # [T]
        self._dev: dict[str, tuple[Tensor, Tensor, Tensor]] = {}

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_groups(cls, prompts: Sequence[Tensor], responses: Sequence[Sequence[Tensor]]) -> "GroupedBatch":
        """Pack groups given as token ids.

        Args:
            prompts: list of P_g LongTensors [len_g] (1-D).
            responses: list (one entry per prompt) of lists of 1-D LongTensors; responses are numbered
                in this order (group by group) in :meth:`logprobs`.
        """
        prompts, responses = list(prompts), [list(r) for r in responses]
        if not prompts:
            raise ValueError("from_groups: no prompts given")
        if len(prompts) != len(responses):
            raise ValueError(f"from_groups: {len(prompts)} prompts but {len(responses)} response lists "
                             "(give one list of responses per prompt)")
        ps, rs, k = [], [], 0
        for g, (p, r) in enumerate(zip(prompts, responses)):
            ps.append(_ids(p, f"prompt {g}"))
            if not r:
                raise ValueError(f"prompt {g} has no responses: a group needs at least one response")
            out = []
            for j, x in enumerate(r):
                out.append(_ids(x, f"response {j} of prompt {g} (response index {k})"))
                k += 1
            rs.append(out)
        return cls(ps, rs)

    @classmethod
    def from_padded(cls, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                    group_size: int | None = None, group_ids: Sequence | Tensor | None = None) -> "GroupedBatch":
        """Pack trainer tensors (TRL / verl layout): one row per response.

        Args:
            prompt_ids, prompt_mask: [N, Lp], prompts left-padded (mask 1 on real tokens).
            completion_ids, completion_mask: [N, Lc], completions right-padded.
            group_size: G, groups are consecutive rows ``[g*G, (g+1)*G)``; or
            group_ids: [N] ids (any hashable / integer values), authoritative: rows with equal
                ids form a group, rows with different ids are never merged.

        Members of a group must have identical prompt tokens (ValueError naming the group otherwise).
        :meth:`logprobs` returns ``[N, Lc]`` aligned with ``completion_ids``.
        """
        pid, pm, cid, cm = (torch.as_tensor(t) for t in (prompt_ids, prompt_mask, completion_ids, completion_mask))
        for name, t in (("prompt_ids", pid), ("prompt_mask", pm), ("completion_ids", cid), ("completion_mask", cm)):
            if t.ndim != 2:
                raise ValueError(f"from_padded: {name} must be 2-D [N, len], got shape {tuple(t.shape)}")
        n = pid.shape[0]
        if pm.shape != pid.shape or cm.shape != cid.shape or cid.shape[0] != n:
            raise ValueError(f"from_padded: shapes disagree: prompt_ids {tuple(pid.shape)}, prompt_mask "
                             f"{tuple(pm.shape)}, completion_ids {tuple(cid.shape)}, completion_mask {tuple(cm.shape)}")
        pid, cid = pid.cpu(), cid.cpu()
        pm, cm = pm.cpu().bool(), cm.cpu().bool()
        if (pm[:, 1:] < pm[:, :-1]).any():
            bad = int(torch.nonzero((pm[:, 1:] < pm[:, :-1]).any(1))[0])
            raise ValueError(f"from_padded: prompt_mask row {bad} is not left-padded (a 0 after a 1)")
        if (cm[:, 1:] > cm[:, :-1]).any():
            bad = int(torch.nonzero((cm[:, 1:] > cm[:, :-1]).any(1))[0])
            raise ValueError(f"from_padded: completion_mask row {bad} is not right-padded (a 1 after a 0)")
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
            raise ValueError("from_padded: give group_size (consecutive groups) or group_ids")
        plen, clen = pm.sum(1), cm.sum(1)
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
        return cls(prompts, responses, order=order, width=cid.shape[1])

    # ------------------------------------------------------------------ model side
    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    @property
    def position_ids(self) -> Tensor:
        """LongTensor [L], virtual positions."""
        return self.layout.position_ids

    def model_inputs(self, device: torch.device | str | None = None, *, needed_logits_only: bool = False) -> dict:
        """Keyword arguments for the patched model: ``model(**batch.model_inputs())``.

        Returns ``input_ids`` [1, L], ``position_ids`` [1, L] (virtual), ``attention_mask`` (a
        :class:`flexgroup.hf.GroupedMask` carrying the layout) and ``use_cache=False``.

        Args:
            device: where the tensors go (default CPU).
            needed_logits_only: also pass ``logits_to_keep=self.logit_rows``, so the LM head runs
                only on the K rows that :meth:`logprobs` reads (each group's last prompt position
                and its response tokens) and the model returns logits [1, K, V] instead of
                [1, L, V] -- what a trainer's repeated baseline computes too, without the prompt
                rows. Use it in training; leave it off to inspect logits at every position.
        """
        from .hf import GroupedMask, tag_position_ids

        device = torch.device(device) if device is not None else torch.device("cpu")
        pos = self.layout.position_ids.to(device)[None]
        out = {
            "input_ids": self.input_ids.to(device)[None],
            "position_ids": tag_position_ids(pos, self.layout),
            "attention_mask": GroupedMask(self.layout, device),
            "use_cache": False,
        }
        if needed_logits_only:
            out["logits_to_keep"] = self.logit_rows.to(device)
        return out

    # ------------------------------------------------------------------ reading back
    def _meta(self, device: torch.device, needed_only: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        key = (str(device), needed_only)
        if key not in self._dev:
            pred = self._pred_in_rows if needed_only else self._pred_idx
            self._dev[key] = (pred.to(device), self._targets.to(device), self._flat_out.to(device))
        return self._dev[key]

    def logprobs(self, logits: Tensor, temperature: float = 1.0, return_entropy: bool = False,
                 chunk_size: int = 4096) -> Tensor | tuple[Tensor, Tensor]:
        """Per-response token log-probs ``[N, max_len]`` (right-padded with 0, responses in input order).

        Entry ``[i, t] = log p(r_i[t] | P, r_i[:t])``; ``r_i[0]`` is read from the last prompt position.
        Only the logit rows that predict response tokens are gathered (``chunk_size`` rows at a time),
        so no tensor larger than ``[response_tokens, V]`` is built. Half-precision logits are
        upcast to float32 per chunk.

        Args:
            logits: [1, L, V] (or [L, V]) from ``model(**batch.model_inputs())``, or [1, K, V] from
                ``model_inputs(needed_logits_only=True)`` (K = ``len(self.logit_rows)``).
            temperature: logits are divided by it before the softmax.
            return_entropy: also return the entropy of each predictive distribution, [N, max_len].
        """
        if logits.ndim == 3:
            if logits.shape[0] != 1:
                raise ValueError(f"logprobs: expected logits [1, L, V] for one packed row, got {tuple(logits.shape)}")
            logits = logits[0]
        needed_only = logits.ndim == 2 and logits.shape[0] == self.logit_rows.numel() != self.num_tokens
        if logits.ndim != 2 or not (logits.shape[0] == self.num_tokens or needed_only):
            raise ValueError(f"logprobs: expected logits [1, {self.num_tokens}, V] (every position) or "
                             f"[1, {self.logit_rows.numel()}, V] (model_inputs(needed_logits_only=True)), "
                             f"got {tuple(logits.shape)}")
        if not temperature > 0:
            raise ValueError(f"logprobs: temperature must be > 0, got {temperature!r}")
        pred, tgt, flat = self._meta(logits.device, needed_only)
        work = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
        lps, ents = [], []
        for a in range(0, pred.numel(), chunk_size):
            x = logits.index_select(0, pred[a:a + chunk_size]).to(work)  # [c, V]
            if temperature != 1.0:
                x = x / temperature
            lse = torch.logsumexp(x, dim=-1)                              # [c]
            lps.append(x.gather(1, tgt[a:a + chunk_size, None])[:, 0] - lse)
            if return_entropy:
                p = torch.softmax(x, dim=-1)
                ents.append(lse - (p * x).sum(-1))
        n, w = self.num_responses, self.max_len
        out = torch.zeros(n * w, dtype=work, device=logits.device).index_put((flat,), torch.cat(lps)).view(n, w)
        if not return_entropy:
            return out
        ent = torch.zeros(n * w, dtype=work, device=logits.device).index_put((flat,), torch.cat(ents)).view(n, w)
        return out, ent

    def __repr__(self) -> str:
        return (f"GroupedBatch({len(self.layout.roots)} groups, {self.num_responses} responses, "
                f"{self.num_tokens} tokens)")
