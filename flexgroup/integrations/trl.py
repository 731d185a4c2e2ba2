"""TRL ``GRPOTrainer`` with shared-prefix (grouped) forwards.

Two ways in::

    from flexgroup.integrations.trl import FlexGroupGRPOTrainer, patch_trainer

    trainer = FlexGroupGRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)
    # or, for an existing trainer (also a subclass of GRPOTrainer):
    trainer = patch_trainer(GRPOTrainer(...))

The adapter shuffles whole groups instead of rows (:func:`shuffle_groups`, drawn with TRL's own
``torch.randperm`` so generation's RNG advances as under stock TRL), and replaces
``_get_per_token_logps_and_entropies`` (policy, old policy, reference) with one grouped forward per chunk of
rows: every common prefix of the ``[prompt; completion]`` rows encoded once
(:meth:`flexgroup.GroupedBatch.from_padded` with ``share="trie"``), the same ``[rows, completion_len]``
log-probs and entropies the stock method returns. TRL's loss, generation, rewards and advantages are
untouched; ``flexgroup_budget`` streams chunks bigger than one forward
(:mod:`~flexgroup.integrations.trl_stream`); images on Qwen2-VL, Qwen2.5-VL and Qwen3-VL go through
:class:`~flexgroup.data.multimodal.MultimodalGroupedBatch` (:mod:`~flexgroup.integrations.trl_vision`); inputs it
does not pack go through the stock method;
``trainer.flexgroup_stats`` counts tokens per role. The grouped method sits right above ``GRPOTrainer`` in
the MRO, so overrides that call ``super()`` stay grouped. Details and limits: docs/trl.md.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections import defaultdict
from typing import Any, Sequence

import torch

try:
    from trl import GRPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without trl
    raise ImportError('flexgroup.integrations.trl needs TRL: pip install -e ".[trl]" in the flexgroup clone') from e

import flexgroup
from flexgroup.data.batch import GroupedBatch
from flexgroup.data.fused_readout import hidden_forward
from flexgroup.integrations.trl_stream import StreamedRows, average_gradients, check_trainer, data_parallel
from flexgroup.integrations import trl_vision
from flexgroup.integrations.trl_head import float32_head, fused_readout, temperature

__all__ = ["FlexGroupGRPOTrainer", "FlexGroupMixin", "patch_trainer", "shuffle_groups", "group_units"]

Tensor = torch.Tensor

# the names under which TRL versions import their row shuffle into grpo_trainer's namespace
_SHUFFLE_NAMES = ("shuffle_sequence_dict", "shuffle_tensor_dict")
# arguments of _get_per_token_logps_and_entropies that the grouped path implements itself
_HANDLED = ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
            "compute_aux_loss")


# ---------------------------------------------------------------------------------------------- shuffling
def group_units(prompt_ids: Tensor, prompt_mask: Tensor | None = None, max_size: int | None = None) -> list[list[int]]:
    """Split rows into groups: maximal runs of consecutive rows with identical prompts.

    Args:
        prompt_ids: [N, Lp] (left-padded) prompt tokens; prompt_mask: [N, Lp] or None.
        max_size: runs longer than this are cut into pieces of ``max_size`` rows (TRL's
            ``num_generations``: the same prompt drawn twice makes two groups).

    Returns:
        list of row-index lists, in order, covering ``range(N)``.
    """
    keys = prompt_ids if prompt_mask is None else torch.where(prompt_mask.bool(), prompt_ids, -1)
    n = keys.shape[0]
    units: list[list[int]] = []
    for i in range(n):
        if (units and torch.equal(keys[i], keys[units[-1][-1]])
                and (max_size is None or len(units[-1]) < max_size)):
            units[-1].append(i)
        else:
            units.append([i])
    return units


def shuffle_groups(seq_dict: dict[str, Any], units: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Shuffle a TRL batch dict by whole groups (same value types as TRL's ``shuffle_sequence_dict``).

    Args:
        seq_dict: key -> Tensor [N, ...] / list of length N / 0-d Tensor / None.
        units: row-index groups covering ``range(N)`` (:func:`group_units`).

    Returns:
        the dict with rows reordered: a uniformly random permutation of the groups, each group's rows
        kept together and in order. The draw is TRL's own, ``torch.randperm(N)`` over the N rows (the
        groups are ordered by where that permutation sends their first rows), so the global RNG
        advances exactly as under the stock trainer and later sampling (generation) is unchanged.
    """
    n = sum(len(u) for u in units)
    where = torch.empty(n, dtype=torch.long)
    where[torch.randperm(n)] = torch.arange(n)          # where TRL's row shuffle sends each row
    order = sorted(range(len(units)), key=lambda u: int(where[units[u][0]]))
    perm = torch.tensor([i for u in order for i in units[u]], dtype=torch.long)

    def permute(v):
        if v is None or (isinstance(v, Tensor) and v.ndim == 0):
            return v
        if len(v) != n:
            raise ValueError(f"shuffle_groups: a value has {len(v)} rows, the groups cover {n}")
        if isinstance(v, Tensor):
            return v[perm.to(v.device)]
        return [v[i] for i in perm.tolist()]

    return {k: permute(v) for k, v in seq_dict.items()}


# ---------------------------------------------------------------------------------------------- trainer
_METHOD = "_get_per_token_logps_and_entropies"


def _stock_method(cls: type):
    """The method FlexGroupMixin's grouped path stands in for: the next definition below the mixin in
    ``cls``'s MRO, which must be ``GRPOTrainer``'s own. An override between the two (a user subclass or
    mixin) would be bypassed on the grouped path, so it is refused with the fix."""
    mro = cls.__mro__
    if GRPOTrainer not in mro or FlexGroupMixin not in mro:
        raise TypeError(f"{cls.__name__}: flexgroup supports TRL's GRPOTrainer and its subclasses")
    below = mro[mro.index(FlexGroupMixin) + 1:]
    between = [k.__name__ for k in below[:below.index(GRPOTrainer)] if _METHOD in vars(k)]
    if between:
        raise TypeError(f"{cls.__name__}: {', '.join(between)} override(s) {_METHOD} below FlexGroupMixin in the "
                        "class hierarchy, so the grouped forward would bypass them: list FlexGroupMixin right "
                        "before GRPOTrainer in the bases (class T(YourMixins, FlexGroupMixin, GRPOTrainer)), "
                        "subclass FlexGroupGRPOTrainer, or convert an instance with patch_trainer")
    for k in below:
        if _METHOD in vars(k):
            return vars(k)[_METHOD]
    raise TypeError(f"{cls.__name__}: no {_METHOD} to adapt: flexgroup supports TRL's GRPOTrainer and its subclasses")


class FlexGroupMixin:
    """Adds shared-prefix forwards to a ``GRPOTrainer`` (sub)class; see the module docstring."""

    flexgroup_backend: str = "auto"
    flexgroup_budget: int | None = None
    flexgroup_fused: bool = False   # log-probs from the hidden states and the LM head (flexgroup.data.fused_readout)
    _flexgroup_local = False   # budget under DDP: forwards on the unwrapped module, gradients averaged by us

    # ------------------------------------------------------------------ setup
    def _flexgroup_setup(self, backend: str = "auto", budget: int | None = None, fused: bool = False) -> None:
        self.flexgroup_budget = None if budget is None else check_trainer(self, budget)
        self.flexgroup_fused = bool(fused)
        self._flexgroup_local = budget is not None and data_parallel(self)
        self.flexgroup_backend = backend
        self.flexgroup_stats: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        # where TRL placed the groups of this process's generation batches: groups, split_groups (fewer than
        # num_generations rows here: the rest sit on other processes), split_rows, split_prompt_tokens
        self.flexgroup_groups: dict[str, int] = defaultdict(int)
        self._flexgroup_warned: set[str] = set()
        for m in (self.model, getattr(self, "ref_model", None)):
            if m is not None:
                flexgroup.patch(self.accelerator.unwrap_model(m), backend=backend)
        self._flexgroup_sig = inspect.signature(inspect.unwrap(_stock_method(type(self))))
        # TRL >= 1.x returns (logps, entropies, aux_loss); earlier releases (logps, entropies)
        self._flexgroup_arity = 3 if "compute_aux_loss" in self._flexgroup_sig.parameters else 2

    def _flexgroup_warn(self, key: str, msg: str) -> None:
        if key not in self._flexgroup_warned:
            self._flexgroup_warned.add(key)
            warnings.warn(msg, stacklevel=3)

    # ------------------------------------------------------------------ (a) keep groups together
    def _prepare_inputs(self, generation_batch):
        mod = sys.modules[GRPOTrainer.__module__]
        names = [n for n in _SHUFFLE_NAMES if hasattr(mod, n)]
        if not names:
            self._flexgroup_warn("shuffle", "flexgroup: this TRL version has no row shuffle to replace; groups are "
                                 "packed as they come (results stay exact)")
            return super()._prepare_inputs(generation_batch)
        saved = {n: getattr(mod, n) for n in names}

        def shuffle(seq_dict):
            if seq_dict.get("prompt_ids") is None:
                return saved[names[0]](seq_dict)
            units = group_units(seq_dict["prompt_ids"], seq_dict.get("prompt_mask"), max_size=self.num_generations)
            self._flexgroup_count_groups(units, seq_dict["prompt_ids"], seq_dict.get("prompt_mask"))
            steps = max(1, int(self.args.steps_per_generation))
            per_step = len(seq_dict["prompt_ids"]) // steps
            if steps > 1 and (any(len(u) != self.num_generations for u in units) or per_step % self.num_generations):
                self._flexgroup_warn(
                    "split", f"flexgroup: groups of {self.num_generations} completions do not tile micro-batches of "
                    f"{per_step} rows on this process; some groups are split across micro-batches (exact, less "
                    "sharing). Make per_device_train_batch_size a multiple of num_generations")
            return shuffle_groups(seq_dict, units)

        for n in names:
            setattr(mod, n, shuffle)
        try:
            return super()._prepare_inputs(generation_batch)
        finally:
            for n, f in saved.items():
                setattr(mod, n, f)

    def _flexgroup_count_groups(self, units: list[list[int]], prompt_ids: Tensor, prompt_mask: Tensor | None) -> None:
        """Count the groups of this process's generation batch, and those TRL's ``RepeatSampler`` split over
        processes; ``split_prompt_tokens``: the prompt tokens of the split groups' parts here (a group cut
        into k parts encodes its prompt k times instead of once)."""
        G, W, rows = self.num_generations, self.accelerator.num_processes, prompt_ids.shape[0]
        split = [u for u in units if len(u) < G]
        c = self.flexgroup_groups
        c["groups"] += len(units)
        c["split_groups"] += len(split)
        c["split_rows"] += sum(len(u) for u in split)
        c["split_prompt_tokens"] += sum(int(prompt_mask[u[0]].sum()) if prompt_mask is not None
                                        else prompt_ids.shape[1] for u in split)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["flexgroup/split_group_fraction"].append(len(split) / max(1, len(units)))
        if W > 1 and rows % G:
            self._flexgroup_warn(
                "straddle", f"flexgroup: {rows} rows per generation batch on each of {W} processes is not a multiple of "
                f"num_generations={G}, so TRL's RepeatSampler spreads groups over processes and each process encodes "
                "the shared prompt of its part again (exact, less sharing; counted in trainer.flexgroup_groups). Set "
                "per_device_train_batch_size x steps_per_generation to a multiple of num_generations")

    def training_step(self, *args, **kwargs):
        out = super().training_step(*args, **kwargs)
        if self._flexgroup_local and self.accelerator.sync_gradients:
            average_gradients(self.accelerator.unwrap_model(self.model))   # what DDP's reducer would have done
        return out

    # ------------------------------------------------------------------ (b) grouped log-probs
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        """Same contract as TRL's method: ``logps`` [B, logits_to_keep] (and ``entropies``), via grouped forwards."""
        stock = super()._get_per_token_logps_and_entropies
        a = self._flexgroup_sig.bind(self, *args, **kwargs)
        a.apply_defaults()
        p = a.arguments
        model, input_ids, attention_mask, k = p["model"], p["input_ids"], p["attention_mask"], int(p["logits_to_keep"])
        reason, vision, rope = None, None, trl_vision.vision_rope(self.accelerator.unwrap_model(model))
        # a Qwen-VL model's visual inputs go through MultimodalGroupedBatch (trl_vision)
        handled = _HANDLED + (trl_vision.VISION_ARGS if rope is not None else ())
        star = {n: self._flexgroup_sig.parameters[n].kind for n in p}
        star = {n: star[n] in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL) for n in p}
        extra = [n for n, v in p.items() if (v if star[n] else n not in handled and v is not None)]
        if extra:
            reason = f"inputs flexgroup does not pack: {sorted(extra)}"
        elif p.get("compute_aux_loss"):
            reason = "MoE auxiliary loss requested (its token statistics depend on the batch layout)"
        elif k <= 0 or k >= input_ids.shape[1]:
            reason = f"logits_to_keep={k} leaves no prompt columns"
        elif rope is not None and bool((attention_mask[:, :-k].sum(1) == 0).any()):
            reason = "a row with an empty prompt on a vision-language model"
        elif float32_head(self) and (rope is not None or self.flexgroup_budget is not None):
            reason = ("cast_lm_head_to_fp32 under mixed precision with a Qwen-VL model or a token budget: TRL's head "
                      "runs in float32 outside autocast, these readouts read the model's autocast logits")
        role = self._flexgroup_role(model)
        stats = self.flexgroup_stats[role]
        if reason is None and rope is not None:
            vision, reason = trl_vision.rows_vision(rope, p, input_ids, attention_mask, stats)
        if self._flexgroup_local:   # budget under DDP: no forward through DDP's reducer (see trl_stream)
            model = p["model"] = self.accelerator.unwrap_model(model)
        if reason is not None:
            self._flexgroup_warn(reason, f"flexgroup: stock TRL forward ({reason}); exact, without sharing")
            stats["fallback_tokens"] += input_ids.numel()
            return stock(*a.args[1:], **a.kwargs)

        compute_entropy = bool(p.get("compute_entropy"))
        B = input_ids.shape[0]
        bs = p.get("batch_size") or B
        logps, ents = [], []
        before = (stats["grouped_tokens"], stats["baseline_tokens"])
        for s in range(0, B, bs):
            ids, am = input_ids[s:s + bs], attention_mask[s:s + bs]
            lp, en = self._flexgroup_chunk(model, ids, am, k, compute_entropy, stats,
                                           None if vision is None else vision[s:s + bs])
            if lp is None:  # a chunk with an empty prompt: stock path for these rows
                self._flexgroup_warn("empty", "flexgroup: a row with an empty prompt goes through the stock forward")
                sub = dict(p)
                sub.pop("self")
                sub.update(input_ids=ids, attention_mask=am, batch_size=None)
                res = stock(**sub)
                lp, en = res[0], res[1]
                stats["fallback_tokens"] += ids.numel()
            logps.append(lp)
            ents.append(en)
        out_lp = torch.cat(logps, 0)
        out_en = torch.cat(ents, 0) if compute_entropy else None
        mode = "train" if self.model.training else "eval"
        grouped, baseline = stats["grouped_tokens"] - before[0], stats["baseline_tokens"] - before[1]
        if baseline:
            self._metrics[mode]["flexgroup/token_fraction"].append(grouped / baseline)
        return (out_lp, out_en, None) if self._flexgroup_arity == 3 else (out_lp, out_en)

    def _flexgroup_role(self, model) -> str:
        ref = getattr(self, "ref_model", None)
        if ref is not None and model is ref:
            return "ref"
        return "policy" if torch.is_grad_enabled() else "old"

    def _flexgroup_chunk(self, model, ids: Tensor, am: Tensor, k: int, compute_entropy: bool, stats: dict,
                         vision: list | None = None) -> tuple[Tensor | None, Tensor | None]:
        """One packed forward for rows ``ids`` [b, Lp + k]; returns ([b, k] log-probs, [b, k] entropies or None).
        ``vision``: per row its visual inputs on a Qwen-VL model (:func:`trl_vision.rows_vision`), else None."""
        pid, pm, cid, cm = ids[:, :-k], am[:, :-k], ids[:, -k:], am[:, -k:]
        if (pm.sum(1) == 0).any():
            return None, None
        keep = torch.nonzero(cm.sum(1) > 0)[:, 0]            # rows with a non-empty completion
        b = ids.shape[0]
        device = ids.device
        stats["baseline_tokens"] += ids.numel()
        stats["real_tokens"] += int(am.sum())
        if keep.numel() == 0:
            stats["forwards"] += 1
            z = torch.zeros(b, k, device=device)
            return z, (z.clone() if compute_entropy else None)
        pid, pm, cid, cm = pid[keep], pm[keep], cid[keep], cm[keep]
        # every common prefix of the [prompt; completion] rows is encoded once: identical prompts, a shared
        # system prompt, earlier turns that multi-turn completions have in common (and, on a Qwen-VL model,
        # the images of a shared prompt)
        rows = None
        if vision is not None:
            batch, rows = trl_vision.vision_batch(self, model, pid, pm, cid, cm, [vision[i] for i in keep], stats)
        else:
            batch = GroupedBatch.from_padded(pid, pm, cid, cm, share="trie")
        stats["grouped_tokens"] += batch.num_tokens
        if self.flexgroup_budget is not None and batch.num_tokens > self.flexgroup_budget:
            # too many tokens for one forward: streamed (kept prefixes, forwards of at most the budget)
            rows = rows or StreamedRows(self, model, pid, pm, cid, cm, tokens=batch.num_tokens)
            lp, en = rows.run(compute_entropy, stats)
        else:
            stats["forwards"] += 1
            with self.accelerator.autocast():
                inputs = batch.model_inputs(device, needed_logits_only=True)
                fused = vision is None and fused_readout(self)   # vision batches: the logits readout (exact)
                out, head = hidden_forward(model, inputs) if fused else (model(**inputs).logits, None)
            res = batch.logprobs(out, temperature=temperature(self, model), return_entropy=compute_entropy, lm_head=head)
            lp, en = (res if compute_entropy else (res, None))
            if rows is not None:   # [rows, T] of whole sequences -> TRL's [rows, k]
                lp, en = rows.to_rows(lp), (rows.to_rows(en) if en is not None else None)
        if keep.numel() == b:
            return lp, en
        full_lp = lp.new_zeros(b, k).index_copy(0, keep, lp)
        full_en = en.new_zeros(b, k).index_copy(0, keep, en) if en is not None else None
        return full_lp, full_en

    def flexgroup_report(self) -> str:
        """One line per role: tokens through the model, grouped vs the stock forward."""
        lines = []
        for role, s in self.flexgroup_stats.items():
            if s["baseline_tokens"]:
                lines.append(f"{role}: {s['grouped_tokens']} grouped tokens vs {s['baseline_tokens']} stock "
                             f"({s['real_tokens']} non-padding), {s['forwards']} forwards, fraction "
                             f"{s['grouped_tokens'] / s['baseline_tokens']:.3f}")
            if s["streamed_forwards"]:
                again = (f" ({s['recomputed_forwards']} of them, {s['recomputed_tokens']} tokens, run again in the "
                         "backward)" if s["recomputed_forwards"] else "")
                lines.append(f"{role}: {s['streamed_forwards']} of the forwards streamed under the budget of "
                             f"{self.flexgroup_budget} tokens{again}")
            if s["fallback_tokens"]:
                lines.append(f"{role}: {s['fallback_tokens']} tokens through the stock forward")
        g = getattr(self, "flexgroup_groups", {})
        if g.get("split_groups"):
            lines.append(f"groups: {g['split_groups']} of {g['groups']} split ({g['split_rows']} rows here) across "
                         "processes")
        return "\n".join(lines)


class FlexGroupGRPOTrainer(FlexGroupMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` with shared-prefix forwards; same arguments plus ``flexgroup_backend`` and
    ``flexgroup_budget``.

    Args:
        flexgroup_backend: attention backend for :func:`flexgroup.patch` (``"auto"``: flex on CUDA,
            the exact lse backend on CPU).
        flexgroup_budget: None (default: one packed forward per chunk of rows), or the most tokens one
            forward may hold (an int >= 128): chunks of rows whose packed row is longer are streamed
            (:mod:`flexgroup.integrations.trl_stream`), same log-probs and gradients.
        flexgroup_fused: read the log-probs of one-forward rows from the hidden states and the LM head, never
            holding the logits (:mod:`flexgroup.data.fused_readout`); streamed rows and Qwen-VL batches keep the
            logits readout. Under mixed precision it follows TRL's head (:mod:`flexgroup.integrations.trl_head`):
            on with ``cast_lm_head_to_fp32`` (with a budget or a Qwen-VL model that sends the call to TRL's
            method, one warning), off without it (one warning).
    """

    def __init__(self, *args, flexgroup_backend: str = "auto", flexgroup_budget: int | None = None,
                 flexgroup_fused: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._flexgroup_setup(flexgroup_backend, flexgroup_budget, flexgroup_fused)


_CONVERTED: dict[type, type] = {GRPOTrainer: FlexGroupGRPOTrainer}


def patch_trainer(trainer: GRPOTrainer, backend: str = "auto", budget: int | None = None,
                  fused: bool = False) -> GRPOTrainer:
    """Turn an existing ``GRPOTrainer`` (or subclass) instance into a flexgroup one, in place.

    Patches its policy and reference models (:func:`flexgroup.patch`) and swaps the instance's class
    ``C`` for ``FlexGroupC(C, FlexGroupGRPOTrainer)``: the grouped path sits right above ``GRPOTrainer``
    in the MRO, so ``C``'s own overrides (a logging wrapper of ``_get_per_token_logps_and_entropies``
    that calls ``super()``, a custom ``_prepare_inputs``) still run and wrap it. Idempotent. ``budget``, ``fused``:
    as ``FlexGroupGRPOTrainer``'s ``flexgroup_budget``, ``flexgroup_fused``. Returns ``trainer``.
    """
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"patch_trainer expects a trl.GRPOTrainer (or subclass), got {type(trainer).__name__}")
    if budget is not None:
        check_trainer(trainer, budget)   # before the class swap: a refused budget leaves the trainer as it was
    cls = type(trainer)
    if not issubclass(cls, FlexGroupMixin):
        if cls not in _CONVERTED:
            _CONVERTED[cls] = type(f"FlexGroup{cls.__name__}", (cls, FlexGroupGRPOTrainer), {"__module__": __name__})
        trainer.__class__ = _CONVERTED[cls]
    trainer._flexgroup_setup(backend, budget, fused)
    return trainer
