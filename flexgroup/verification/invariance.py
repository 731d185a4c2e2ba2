"""Is a grouped forward batch-invariant on this model? Each tree alone vs packed with others, bitwise.

:func:`check_batch_invariance` scores the trie of the caller's sequences (``GroupedBatch.from_sequences``)
alone, then packed after and before *neighbours* -- by default the same sequences under another first
token: a separate tree of exactly the same shape, the row-mate most likely to share a kernel call --,
in tries of other shapes (each sequence alone, as a micro-batch that splits a group holds it; beside a
sequence that shares the first half of the first one, which moves a segment boundary into its prompt)
and, when the sequences form several trees, each tree alone. Each arrangement is one forward without
gradients (a trainer's old-log-prob or reference pass), read as training reads it (the needed logit
rows only), and its log-probs and entropies are compared with the arrangement alone by ``torch.equal``.

It also reports, for every distinct linear layer of the model, the row counts (1-16) at which a row
of its output differs bitwise from the same row computed among 64 rows: the model's own matmuls are
outside flexgroup's control, and a backend may take another kernel for a call of few rows
(docs/batch-invariance.md). The caller's model is used as it is (patched, on its device); nothing
is copied or changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["check_batch_invariance", "InvarianceReport", "Arrangement"]

SPLIT_CHECKS = 8   # sequences also scored alone (one forward each)


@dataclass(frozen=True)
class Arrangement:
    """One packing of the sequences compared with them alone: bitwise equal or not, and the largest difference."""

    name: str
    logprobs_equal: bool
    entropies_equal: bool
    max_abs_diff: float

    @property
    def equal(self) -> bool:
        return self.logprobs_equal and self.entropies_equal


@dataclass
class InvarianceReport:
    """What :func:`check_batch_invariance` found.

    Attributes:
        arrangements: one entry per packing compared with the sequences alone.
        linear_rows: per distinct linear layer shape (``"in->out dtype"``), the row counts in 1-16 at
            which a row's output is not bitwise the one computed among 64 rows (empty: invariant).
    """

    arrangements: list[Arrangement]
    linear_rows: dict[str, list[int]] = field(default_factory=dict)

    @property
    def invariant(self) -> bool:
        """True when every arrangement gave bitwise equal log-probs and entropies."""
        return all(a.equal for a in self.arrangements)

    def __str__(self) -> str:
        lines = [f"batch-invariant forward: {'yes' if self.invariant else 'NO'}"]
        for a in self.arrangements:
            state = "bitwise equal" if a.equal else f"differ, max |diff| {a.max_abs_diff:.3g}"
            lines.append(f"  {a.name}: {state}")
        for shape, rows in self.linear_rows.items():
            if rows:
                lines.append(f"  linear {shape}: a call of {', '.join(map(str, rows))} row(s) takes another kernel")
        return "\n".join(lines)


def _scores(model, sequences, loss_masks, device) -> tuple[torch.Tensor, torch.Tensor]:
    from ..data.batch import GroupedBatch

    batch = GroupedBatch.from_sequences(sequences, loss_masks)
    with torch.no_grad():
        logits = model(**batch.model_inputs(device, needed_logits_only=True)).logits
    lp, ent = batch.logprobs(logits, return_entropy=True)                   # [N, T] each
    return lp.cpu(), ent.cpu()


def _compare(name: str, alone, packed) -> Arrangement:
    (lp, ent), (plp, pent) = alone, packed
    T = lp.shape[1]
    plp, pent = plp[:, :T], pent[:, :T]     # a longer neighbour widens the batch's columns (zeros)
    diff = max((lp - plp).abs().max().item(), (ent - pent).abs().max().item()) if lp.numel() else 0.0
    return Arrangement(name, torch.equal(lp, plp), torch.equal(ent, pent), diff)


def linear_row_counts(model, rows: int = 64, upto: int = 16) -> dict[str, list[int]]:
    """Per distinct ``nn.Linear`` shape of ``model``: the row counts ``m <= upto`` whose output rows differ
    bitwise from the first ``m`` rows of one call on ``rows`` random rows (same weights, dtype, device)."""
    out: dict[str, list[int]] = {}
    g = torch.Generator().manual_seed(0)
    for mod in model.modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        w = mod.weight
        key = f"{mod.in_features}->{mod.out_features} {str(w.dtype).replace('torch.', '')}"
        if key in out:
            continue
        with torch.no_grad():
            x = torch.randn(rows, mod.in_features, generator=g).to(w.device, w.dtype)
            full = torch.nn.functional.linear(x, w, mod.bias)
            out[key] = [m for m in range(1, upto + 1)
                        if not torch.equal(torch.nn.functional.linear(x[:m], w, mod.bias), full[:m])]
    return out


def check_batch_invariance(model, sequences, loss_masks=None, *, neighbours=None) -> InvarianceReport:
    """Whether ``sequences`` get bitwise the same log-probs and entropies whatever shares their packed row.

    Args:
        model: a model patched by :func:`flexgroup.patch` (used as it is, on its device).
        sequences: N 1-D token-id tensors, as for :meth:`GroupedBatch.from_sequences`.
        loss_masks: optional, as there.
        neighbours: sequences packed beside them (default: each of ``sequences`` with its first token
            replaced by one no sequence starts with -- separate trees of the same shapes).

    Returns:
        an :class:`InvarianceReport`; ``str(report)`` is a short table, ``report.invariant`` the verdict.
    """
    from ..layout.checks import check_sequences
    from ..patches import is_patched

    if not is_patched(model):
        raise ValueError("check_batch_invariance: the model is not patched; call flexgroup.patch(model) first "
                         "(the check is about flexgroup's grouped forward)")
    seqs = check_sequences(sequences)
    masks = list(loss_masks) if loss_masks is not None else None
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    if neighbours is None:
        firsts = {int(s[0]) for s in seqs}
        free = next((t for t in range(vocab) if t not in firsts), None)
        if free is None:
            raise ValueError("check_batch_invariance: every token id starts a sequence; pass neighbours= yourself")
        neighbours = [torch.cat([s.new_tensor([free]), s[1:]]) for s in seqs]
    others = check_sequences(neighbours)
    n = len(seqs)
    pad = [torch.ones(len(s), dtype=torch.bool) for s in others]
    for p in pad:
        p[0] = False
    alone = _scores(model, seqs, masks, device)
    rows = []
    after = _scores(model, others + seqs, None if masks is None else pad + masks, device)
    rows.append(_compare("after the neighbours", alone, tuple(x[len(others):] for x in after)))
    before = _scores(model, seqs + others, None if masks is None else masks + pad, device)
    rows.append(_compare("before the neighbours", alone, tuple(x[:n] for x in before)))
    # tries of other shapes around the same sequences: each one alone (a micro-batch that splits a group), and
    # beside a sequence that shares the first half of sequence 0 (a segment boundary moves into its prompt)
    for i in range(min(n, SPLIT_CHECKS)):
        single = _scores(model, [seqs[i]], None if masks is None else [masks[i]], device)
        rows.append(_compare(f"sequence {i} alone vs in the batch", single, tuple(x[i:i + 1] for x in alone)))
    s0 = seqs[0]
    half = max(1, len(s0) // 2)
    vocab = model.get_input_embeddings().num_embeddings
    sharer = torch.cat([s0[:half], (s0[half:] + 1) % vocab]) if len(s0) > 1 else torch.cat([s0, s0])
    sharer_mask = torch.ones(len(sharer), dtype=torch.bool)
    sharer_mask[0] = False
    shared = _scores(model, [sharer] + seqs, None if masks is None else [sharer_mask] + masks, device)
    rows.append(_compare("beside a sequence that shares the first half of sequence 0", alone,
                         tuple(x[1:] for x in shared)))
    trees: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        trees.setdefault(int(s[0]), []).append(i)
    if len(trees) > 1:
        for first, idx in trees.items():
            own = _scores(model, [seqs[i] for i in idx], None if masks is None else [masks[i] for i in idx], device)
            rows.append(_compare(f"the tree starting with token {first}, alone vs in the batch", own,
                                 tuple(x[idx] for x in alone)))
    return InvarianceReport(rows, linear_row_counts(model))
