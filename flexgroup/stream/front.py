"""Batches bigger than one forward: stream them with every shared prefix encoded once (front).

:func:`stream_backward` runs a loss over sequences of any size under a per-forward token budget and
leaves in ``.grad`` exactly what one backward over the unchunked batch would -- and so, when the loss
is a sum over sequences, what each sequence run alone through the stock model gives. How
(schedule: :mod:`flexgroup.stream.plan`; kept keys and values: :mod:`flexgroup.stream.chunk_carrier`):

1. trees of the prefix trie that fit the budget are packed into rows and run as ordinary packed
   forwards (``GroupedBatch`` + one forward + backward each);
2. larger trees run in chunks of at most ``budget`` tokens, ancestors first. Each chunk attends to
   the keys and values (after RoPE) that earlier chunks kept for its ancestor segments, as leaves
   that require grad, and keeps its own for later chunks; a sequence's log-probs are assembled in
   the chunk holding its last token (log-probs produced earlier are kept leaves too), where
   ``loss_fn`` runs on them;
3. a chunk that nobody reads from runs its backward at once (its graph is freed); a chunk that later
   chunks read from keeps its graph until they all have run, then runs one backward of its own loss
   plus ``<kept originals, accumulated leaf gradients>``. So a shared prefix is encoded once and
   back-propagated once, and peak memory holds the prefix's graph plus one chunk.

The loss must be a sum over chunks of ``loss_fn`` for the gradients to be exact: for a batch mean,
pass the global normaliser (e.g. ``flexgroup.train.grpo.policy_loss(..., normalizer=total_tokens)``).

On a model patched with ``sequence_parallel=group`` every forward of the same schedule is sharded over
the group's ranks, the kept keys and values by heads (:mod:`flexgroup.stream.shard`). Vision-language trees
(``vision=``): every tree in chunks, the tower once per distinct image (:mod:`flexgroup.stream.vision`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from ..data.batch import GroupedBatch
from ..data.carrier import tag_position_ids
from ..layout.checks import check_loss_masks, check_sequences, check_temperature
from ..reference.model_checks import check_materialized
from . import shard as stream_shard
from ..data.fused_readout import hidden_forward, read_scores_fused
from ..data.readout import read_plan, read_scores
from .chunk_carrier import ChunkContext, KeptStore, StreamMask
from .plan import ChunkPlan, StreamPlan, plan_stream
from .vision import SUPPORTED as VL_STREAMED, StreamVision, streams_vision

__all__ = ["stream_backward", "stream_logprobs", "stream_forward", "StreamResult", "MIN_BUDGET", "check_budget"]

Tensor = torch.Tensor
MIN_BUDGET = 128  # one kernel block: the smallest forward the streaming schedule cuts


@dataclass
class StreamResult:
    """What :func:`stream_backward` returns.

    Attributes:
        logprobs: [N, T] detached: ``lp[i, t] = log p(seq_i[t] | seq_i[:t])`` on the loss mask, else 0.
        response_mask: [N, T] bool, the loss masks right-padded with False.
        loss: the sum of ``loss_fn`` over every forward, as a float.
        forwards: how many model forwards ran.
        entropy: [N, T] detached entropies of the predictive distributions (of logits / temperature)
            on the loss mask, else 0; None unless asked for (:func:`stream_forward`).
    """

    logprobs: Tensor
    response_mask: Tensor
    loss: float
    forwards: int
    entropy: Tensor | None = None


def stream_backward(model: torch.nn.Module, sequences: Sequence[Tensor], loss_fn: Callable[[Tensor, Tensor], Tensor],
                    *, loss_masks: Sequence[Tensor] | None = None, budget: int, temperature: float = 1.0,
                    sequence_parallel=None, vision: Sequence[Mapping | None] | None = None,
                    fused: bool = False) -> StreamResult:
    """Forward and backward over ``sequences`` in forwards of at most ``budget`` tokens each.

    Args:
        model: a model patched with :func:`flexgroup.patch` (dense decoders, hybrids, Qwen2-VL /
            Qwen2.5-VL / Qwen3-VL with ``vision``; other vision-language models only when every tree fits).
        sequences: N 1-D token-id tensors (on CPU or the model's device), any trie: shared system
            prompts, groups, turns, strict prefixes, duplicates.
        loss_fn: ``loss_fn(lp, index) -> 0-d tensor``; ``lp`` [n, T] (``T`` the longest of all N
            sequences) holds the log-probs of sequences ``index`` (LongTensor [n]) as in
            :attr:`StreamResult.logprobs`. Called once per forward that ends some sequences; the
            gradients equal those of ``sum(loss_fn(...))`` over the calls computed without chunking,
            so the loss must be a sum over sequences (use global normalisers).
        loss_masks: as in :meth:`flexgroup.GroupedBatch.from_sequences`.
        budget: the most tokens one forward may hold (>= 128). The kept keys and values of a
            forward's shared ancestors are not counted.
        temperature: log-probs are those of ``logits / temperature`` (TRL's sampling temperature), as in
            :meth:`flexgroup.GroupedBatch.logprobs`; finite and > 0.
        sequence_parallel: None (default): the process group the model was patched with
            (``flexgroup.patch(model, sequence_parallel=group)``), if any; that group itself (checked);
            False: no sharding. With a group, every forward of the same schedule is sharded over its
            ranks (:mod:`flexgroup.stream.shard`): every rank calls with the same arguments, gets the
            whole log-probs and loss, and the ``.grad`` summed over the group is the unsharded gradient.
        vision: on a Qwen-VL / Qwen3.5 model, per sequence its images and videos (or None) as
            :meth:`flexgroup.MultimodalGroupedBatch.from_sequences` takes them (or the processor's one mapping for all
            sequences, split by their placeholders): the tower runs once per distinct
            item, every tree in chunks, the tower's gradient included (:mod:`flexgroup.stream.vision`).
        fused: read log-probs from the final hidden states and the LM head chunk by chunk, never holding the
            ``[rows, V]`` logits (:mod:`flexgroup.data.fused_readout`; not with ``sequence_parallel`` or ``vision``).

    Returns:
        :class:`StreamResult`; the parameters' ``.grad`` is accumulated as by ``backward()``.
    """
    if not torch.is_grad_enabled():
        raise RuntimeError("flexgroup.stream_backward was called under torch.no_grad() or torch.inference_mode(): "
                           "it computes gradients. "
                           "For log-probs without gradients call flexgroup.stream_logprobs")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(lp [n, T], index [n]) -> scalar, got {loss_fn!r}")
    return _Streamer(model, sequences, loss_masks, budget, loss_fn, temperature,
                     sequence_parallel=sequence_parallel, vision=vision, fused=fused).run()


def stream_logprobs(model: torch.nn.Module, sequences: Sequence[Tensor], *,
                    loss_masks: Sequence[Tensor] | None = None, budget: int, temperature: float = 1.0,
                    return_entropy: bool = False, sequence_parallel=None,
                    vision: Sequence[Mapping | None] | None = None, fused: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs [N, T] of ``sequences`` without gradients (old-policy / reference passes), streamed
    under ``budget`` like :func:`stream_backward`; 0 off the loss mask. With ``return_entropy``:
    ``(logprobs, entropies)``, both [N, T] (entropies of ``softmax(logits / temperature)``, 0 off the mask).
    ``sequence_parallel`` as in :func:`stream_backward` (every rank gets the whole [N, T]); ``vision`` (images and
    videos per sequence on a Qwen-VL model) and ``fused`` as in :func:`stream_backward`."""
    res = stream_forward(model, sequences, loss_masks=loss_masks, budget=budget, temperature=temperature,
                         return_entropy=return_entropy, sequence_parallel=sequence_parallel, vision=vision, fused=fused)
    return (res.logprobs, res.entropy) if return_entropy else res.logprobs


def stream_forward(model: torch.nn.Module, sequences: Sequence[Tensor], *,
                   loss_masks: Sequence[Tensor] | None = None, budget: int, temperature: float = 1.0,
                   return_entropy: bool = False, sequence_parallel=None,
                   vision: Sequence[Mapping | None] | None = None, fused: bool = False) -> StreamResult:
    """:func:`stream_logprobs` returning the whole :class:`StreamResult` (``.logprobs``, ``.entropy``
    when ``return_entropy``, ``.forwards``; ``.loss`` is 0): no gradients."""
    with torch.no_grad():
        return _Streamer(model, sequences, loss_masks, budget, None, temperature, return_entropy,
                         sequence_parallel=sequence_parallel, vision=vision, fused=fused).run()


_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def check_budget(budget) -> int:
    """``budget`` as an int (a 0-d integer tensor is its value); ValueError unless it is >= :data:`MIN_BUDGET`."""
    if isinstance(budget, Tensor) and budget.ndim == 0 and budget.dtype in _INT_DTYPES:
        budget = int(budget)  # a 0-d integer tensor is its value
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"budget must be an integer number of tokens per forward, got {budget!r}")
    if budget < MIN_BUDGET:
        raise ValueError(f"budget={budget} is below one block of {MIN_BUDGET} tokens: streamed forwards are cut "
                         f"into at least one block each; use budget >= {MIN_BUDGET}")
    return budget


def _model_device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    if p is None:
        raise TypeError(f"{type(model).__name__} has no parameters: pass the patched transformers model")
    check_materialized(model, "flexgroup.stream")
    return p.device


class _Streamer:
    """One call of stream_backward / stream_logprobs."""

    def __init__(self, model, sequences, loss_masks, budget, loss_fn, temperature=1.0, entropy=False, *,
                 sequence_parallel=None, vision=None, fused=False):
        self.model, self.loss_fn, self.train, self.entropy = model, loss_fn, loss_fn is not None, bool(entropy)
        self.fused = bool(fused)
        self.group = stream_shard.resolve_group(model, sequence_parallel)  # None: this process alone
        try:
            self._check(model, sequences, loss_masks, budget, temperature, vision)
        except Exception:
            stream_shard.refused(self.group, self.train)  # the group's other ranks raise too, naming this one
            raise
        if self.group is not None:
            stream_shard.check_call(self.group, self.device, self.train, self.entropy, self.seqs, self.masks,
                                    self.temperature, self.budget, self.vision.kept if self.vision else None,
                                    self.plan)
        if self.vision is not None:
            self.vision.bind(self.plan.trie)
        N, T = len(self.seqs), self.plan.width
        self.response_mask = torch.zeros(N, T, dtype=torch.bool)
        for i, m in enumerate(self.masks):
            self.response_mask[i, : m.numel()] = m
        self.out: Tensor | None = None
        self.ent: Tensor | None = None
        self.total, self.forwards = 0.0, 0

    def _check(self, model, sequences, loss_masks, budget, temperature, vision) -> None:
        """Check the arguments (each rank its own) and plan the schedule."""
        self.budget = check_budget(budget)
        self.temperature = check_temperature("flexgroup.stream", temperature)
        self.device = _model_device(model)
        if isinstance(sequences, Tensor) or not hasattr(sequences, "__iter__"):
            raise ValueError("sequences must be a list of 1-D token-id tensors, got "
                             f"{type(sequences).__name__}")
        sequences = list(sequences)
        for i, s in enumerate(sequences):
            if isinstance(s, Tensor) and s.device.type != "cpu" and s.device != self.device:
                raise ValueError(f"sequence {i} is on {s.device} but the model is on {self.device}: move the "
                                 f"sequences to {self.device} (or to the CPU)")
        self.seqs = check_sequences(sequences)
        self.masks = check_loss_masks(loss_masks, self.seqs)
        self.vision = StreamVision(model, self.seqs, vision) if streams_vision(model, vision) else None
        self.plan: StreamPlan = plan_stream(self.seqs, self.masks, self.budget, pack_rows=self.vision is None,
                                            keys=self.vision.keys if self.vision is not None else None)
        _check_model(model, self.plan, self.vision is not None)
        if self.group is not None:
            stream_shard.check_streamable(model, self.vision is not None)
        if self.fused and (self.group is not None or self.vision is not None):
            raise NotImplementedError("flexgroup.stream: fused=True reads a text model's hidden states; with "
                                      f"{'sequence_parallel' if self.group is not None else 'vision'} use fused=False")

    # ------------------------------------------------------------------ shared
    def _loss(self, lp: Tensor, index: Tensor, ent: Tensor | None = None) -> Tensor | None:
        """Store ``lp`` (and ``ent``) [n, T]; run ``loss_fn`` (checked) if training."""
        if self.out is None:
            self.out = torch.zeros(len(self.seqs), self.plan.width, dtype=lp.dtype)
            self.ent = self.out.clone() if self.entropy else None
        self.out[index] = lp.detach().to("cpu", self.out.dtype)
        if ent is not None:
            self.ent[index] = ent.detach().to("cpu", self.ent.dtype)
        if not self.train:
            return None
        loss = self.loss_fn(lp, index.to(lp.device))
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a 0-d tensor (a scalar loss for sequences {index.tolist()[:8]}), "
                             f"got {shape}: reduce it, e.g. .sum()")
        if lp.requires_grad and not _reaches(loss, lp):
            raise ValueError("loss_fn returned a tensor that does not depend on lp (the log-probs it was given): "
                             "no gradient would reach the model. Compute the loss from lp, e.g. "
                             "-(lp * advantages[index, None]).sum()")
        self.total += float(loss.detach())
        return loss

    def run(self) -> "StreamResult":
        for row in self.plan.rows:
            self._packed_row(row)
        if self.vision is not None:
            self.vision.encode(self.device)
        if self.plan.chunks:
            self._stream()
        if self.vision is not None and self.train:
            self.vision.backward()  # the tower's one backward, after every chunk's
        if self.out is None:  # pragma: no cover - every sequence ends in some forward
            raise RuntimeError("flexgroup.stream: no forward ran; please report it")
        return StreamResult(self.out, self.response_mask, self.total, self.forwards, self.ent)

    # ------------------------------------------------------------------ trees that fit: one packed forward
    def _packed_row(self, row: list[int]) -> None:
        batch = GroupedBatch._trie_batch([self.seqs[k] for k in row], [self.masks[k] for k in row],
                                         width=self.plan.width)
        if self.group is not None:
            lp, ent = stream_shard.sharded_row(self.model, batch, self.group, self.device, self.temperature,
                                               self.entropy)
            out = None
        else:
            inputs = batch.model_inputs(self.device, needed_logits_only=True)
            out, head = hidden_forward(self.model, inputs) if self.fused else (self.model(**inputs).logits, None)
            res = batch.logprobs(out, temperature=self.temperature, return_entropy=self.entropy, lm_head=head)
            lp, ent = res if self.entropy else (res, None)
        self.forwards += 1
        loss = self._loss(lp, torch.tensor(row, dtype=torch.long), ent)
        del out
        if loss is not None:
            loss.backward()

    # ------------------------------------------------------------------ trees that do not: chunks
    def _stream(self) -> None:
        chunks = self.plan.chunks
        store = KeptStore()
        lp_kept: dict[int, Tensor] = {}            # chunk -> leaf of its produced log-probs (later readers)
        ent_kept: dict[int, Tensor] = {}           # chunk -> its produced entropies (later readers; no grad)
        pending: dict[int, Tensor | None] = {}     # chunk -> its loss, graph held until its readers ran
        lp_originals: dict[int, Tensor] = {}
        done: set[int] = set()
        for c, ch in enumerate(chunks):
            produced, ent = self._forward(c, ch, store)
            if ch.readers and ent is not None:
                ent_kept[c] = ent
            if ch.readers:
                leaf = produced.detach()
                if self.train and produced.requires_grad:
                    leaf.requires_grad_()
                    lp_originals[c] = produced
                lp_kept[c] = leaf
            loss = None
            if ch.sequences is not None:
                parts = [lp_kept[s] if s != c else produced for s in ch.sources]
                src = torch.cat(parts) if len(parts) > 1 else parts[0]
                n = ch.sequences.numel()
                flat, gather = ch.flat.to(src.device), ch.gather.to(src.device)
                lp = src.new_zeros(n * self.plan.width).index_put((flat,), src[gather]).view(n, self.plan.width)
                ent_row = None
                if ent is not None:
                    e = torch.cat([ent_kept[s] if s != c else ent for s in ch.sources])
                    ent_row = e.new_zeros(n * self.plan.width).index_put((flat,), e[gather]).view(n, self.plan.width)
                loss = self._loss(lp, ch.sequences, ent_row)
            pending[c] = loss
            del produced
            # chunks whose readers all ran: backward, newest first (a reader's backward feeds its sources)
            for p in sorted(pending, reverse=True):
                if all(r in done for r in chunks[p].readers):
                    self._backward(p, pending.pop(p), store, lp_originals.pop(p, None), lp_kept.pop(p, None))
                    ent_kept.pop(p, None)
                    done.add(p)
        if pending:  # pragma: no cover - readers are later chunks, all run by now
            raise RuntimeError(f"flexgroup.stream: chunks {sorted(pending)} never ran their backward; please report it")

    def _forward(self, c: int, ch: ChunkPlan, store: KeptStore) -> tuple[Tensor, Tensor | None]:
        """Run chunk ``c``; return the log-probs it produces, [len(ch.produced)] (graph attached when training),
        and their entropies [len(ch.produced)] (detached) when asked for, else None."""
        if self.group is not None:  # this rank's slice of the chunk (flexgroup/stream/shard.py)
            self.forwards += 1
            return stream_shard.sharded_chunk_forward(self.model, self.plan.input_ids, ch, c, store, self.train,
                                                      self.group, self.device, self.temperature, self.entropy,
                                                      self.vision)
        ctx = ChunkContext(c, ch.layout, ch.n_context, ch.context, ch.keep, store, self.train, ch.pieces, ch.external)
        keep = ch.logit_rows if ch.logit_rows.numel() else torch.zeros(1, dtype=torch.long)
        mask, head = StreamMask(ch.row_layout, self.device, ctx), None
        if self.vision is not None:
            logits = self.vision.forward(self.model, ch.tokens, self.plan.input_ids[ch.tokens], ch.positions,
                                         ch.row_layout, mask, keep, self.device)   # [K, V]
        else:
            pos = ch.positions.to(self.device)[None]
            inputs = dict(input_ids=self.plan.input_ids[ch.tokens].to(self.device)[None], attention_mask=mask,
                          position_ids=tag_position_ids(pos, ch.row_layout), use_cache=False,
                          logits_to_keep=keep.to(self.device))
            out, head = hidden_forward(self.model, inputs) if self.fused else (self.model(**inputs).logits, None)
            logits = out[0]                                           # [K, V], or hidden states [K, H] (fused)
        self.forwards += 1
        if not ch.produced.numel():
            work = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
            return logits.new_zeros(0, dtype=work), (logits.new_zeros(0, dtype=work) if self.entropy else None)
        plan = read_plan(ch.produced_rows, self.plan.input_ids[ch.produced], logits.device)  # folded on the CPU
        lp, ent = (read_scores(logits, plan, self.temperature, self.entropy) if not self.fused else   # [P], [P]
                   read_scores_fused(logits, head, plan, self.temperature, self.entropy))
        return lp, (ent.detach() if ent is not None else None)

    def _backward(self, c: int, loss: Tensor | None, store: KeptStore, lp_orig: Tensor | None,
                  lp_leaf: Tensor | None) -> None:
        """Chunk ``c``'s one backward: its loss plus its kept originals with their accumulated gradients."""
        if self.train:
            tensors, grads = [], []
            if loss is not None and loss.requires_grad:
                tensors.append(loss)
                grads.append(torch.ones_like(loss))
            pairs = list(store.originals.get(c, []))
            if lp_orig is not None:
                pairs.append((lp_orig, lp_leaf))
            for orig, leaf in pairs:
                if leaf.grad is not None:
                    tensors.append(orig)
                    grads.append(leaf.grad)
            if tensors:
                torch.autograd.backward(tensors, grads)
        store.release(c, [p for p, _, _ in self.plan.chunks[c].keep])


def _check_model(model: torch.nn.Module, plan: StreamPlan, vision: bool = False) -> None:
    """Refuse, naming the cause and the fix, what streaming cannot make exact (checked once per call)."""
    from ..patches import base_model, check_grouped_call, guards_of, patched_language_model

    base = base_model(model, "stream_backward")
    lm = patched_language_model(base)
    if lm is None:
        raise ValueError(f"flexgroup.stream_backward: {type(base).__name__} is not patched: call flexgroup.patch(model) "
                         "first")
    if not plan.chunks:
        return  # every tree fits the budget: ordinary packed rows, checked by the model's own hooks
    need = max(plan.trie.tree_tokens)
    model_type = getattr(base.config, "model_type", type(base).__name__)
    fix = f"raise the budget to {need} tokens (the largest tree) so that every tree runs as one packed forward"
    if getattr(base.config, "vision_config", None) is not None and not vision:
        raise NotImplementedError(
            f"flexgroup.stream_backward: streaming x vision-language on {model_type} is not supported: images' "
            f"features and M-RoPE positions are carried across chunks only for {', '.join(VL_STREAMED)} "
            f"(flexgroup.stream.vision): use MultimodalGroupedBatch, or {fix}")
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    if getattr(text, "output_router_logits", False):
        raise NotImplementedError(
            "flexgroup.stream_backward: output_router_logits=True (MoE load-balancing loss) reads the whole batch's "
            f"router logits in one forward, which streaming splits: set config.output_router_logits=False or {fix}")
    from ..layout import Layout

    full = Layout.tree(plan.trie.parents, plan.trie.lengths)
    g = guards_of(lm)
    longest = max(full.offsets[s] + full.lengths[s] for s in full.leaves)
    over = [(what, n) for what, n in g.rope_scalings() if longest > n]
    if over:  # before the positions check: past max_position_embeddings, dynamic scaling is the cause to name
        limit = min(n for _, n in over)
        raise NotImplementedError(
            f"flexgroup.stream_backward: this model's RoPE scaling depends on the length of each forward "
            f"({'; '.join(what for what, _ in over)}), and a sequence of {longest} tokens exceeds {limit}: a chunk "
            f"would get other factors than the sequence run alone. Keep sequences within {limit} tokens"
            + ("" if g.dynamic in (n for _, n in over) else f", or {fix}"))
    check_grouped_call(full, getattr(lm.config, "max_position_embeddings", None), model_type)
    if g.temperature_floor is not None and longest >= g.temperature_floor:
        raise NotImplementedError(
            "flexgroup.stream_backward: attention temperature tuning scales queries by each token's index in the "
            f"forward (floor_scale={g.temperature_floor}), which a chunk changes: keep sequences shorter than "
            f"{g.temperature_floor} tokens or {fix}")


def _reaches(loss: Tensor, lp: Tensor) -> bool:
    """Whether ``loss``'s autograd graph contains ``lp`` (a walk from ``loss`` that stops at ``lp``)."""
    target = lp.grad_fn
    if loss.grad_fn is None:
        return False
    seen, stack = set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is target:
            return True
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(f for f, _ in fn.next_functions)
    return False
