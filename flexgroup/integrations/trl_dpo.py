"""TRL ``DPOTrainer`` with each (prompt, chosen, rejected) run as one group of two.

Two ways in::

    from flexgroup.integrations.trl_dpo import FlexGroupDPOTrainer, patch_dpo_trainer

    trainer = FlexGroupDPOTrainer(model=..., args=DPOConfig(...), train_dataset=...)
    # or, for an existing trainer (also a subclass of DPOTrainer):
    trainer = patch_dpo_trainer(DPOTrainer(...))

TRL's DPO batch is ``[chosen rows; rejected rows]``, each row ``[prompt; completion; padding]``, so
every prompt goes through the policy twice and through the reference model twice. TRL calls
``model(input_ids, attention_mask, labels=..., fused_lm_head=True)``: its fused LM head runs the
decoder (``model.base_model``) and then computes per-token log-probs, entropies and the other
metrics from the decoder's hidden states. The adapter replaces only the decoder call: the rows'
real tokens are packed as one prefix trie (a pair's chosen and rejected row share their prompt; rows
that start alike across pairs -- a repeated prompt, a system prompt -- share that too), the packed
row runs once through the patched decoder, and its hidden states are scattered back to the
``[2B, L, H]`` padded layout TRL expects (zeros on padding, whose outputs TRL masks out). TRL's LM head, losses, rewards and metrics run unchanged, for
the policy and for the reference model (separate model, PEFT adapter switching, or
``precompute_ref_log_probs``).

Batches the adapter does not pack go through TRL's stock forward unchanged (exact, no sharing), with
the reason counted in ``trainer.flexgroup_stats[role]["fallback_tokens"]``: rows that are not real tokens
from column 0 followed by right padding, rows of fewer than 2 tokens (truncation), extra model inputs
(images, MoE router logits), multimodal models, and ``return_outputs`` logits.

Covered: ``DPOTrainer`` and its subclasses in TRL releases whose DPO forward uses the fused LM head
(``model(..., fused_lm_head=True)``; detected at construction). Older TRL releases (``concatenated_forward``
over full logits, e.g. 0.20: the constructor raises) and the experimental ORPO / CPO trainers (their
own ``concatenated_forward``; not ``DPOTrainer`` subclasses, so ``patch_dpo_trainer`` refuses them) are
not covered.

Token counts per role (``policy``, ``ref``) in ``trainer.flexgroup_stats``: ``baseline_tokens`` (rows
x width, what the stock forward feeds the decoder), ``real_tokens`` (non-padding) and
``grouped_tokens`` (packed row length).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch

try:
    from trl import DPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without trl
    raise ImportError('flexgroup.integrations.trl_dpo needs TRL: pip install -e ".[trl]" in the flexgroup clone') from e

import flexgroup
from flexgroup.data.batch import GroupedBatch
from flexgroup.integrations import mix_into
from flexgroup.integrations.trl import FlexGroupMixin

__all__ = ["FlexGroupDPOTrainer", "FlexGroupDPOMixin", "patch_dpo_trainer", "pair_plan", "PairPlan"]

Tensor = torch.Tensor

# keyword arguments of TRL's fused DPO call that the grouped decoder call implements
_HANDLED = {"input_ids", "attention_mask", "use_cache", "labels", "fused_lm_head"}
# values that ask for nothing: PEFT's PeftModelForCausalLM (task_type="CAUSAL_LM") passes these explicitly
_NEUTRAL = {"output_attentions": (None, False), "output_hidden_states": (None, False), "return_dict": (None, True)}


@dataclass
class PairPlan:
    """How a TRL DPO batch ``[n, L]`` maps onto one packed row.

    Attributes:
        input_ids: the batch's ``input_ids`` tensor (the adapter groups only the call that passes this
            very tensor).
        batch: the packed :class:`GroupedBatch` (a prefix trie over the rows' real tokens).
        flat: LongTensor [R], ``row * L + column`` of every real token of the batch.
        packed: LongTensor [R], the packed-row index holding that token.
        shape: ``(n, L)``.
    """

    input_ids: Tensor
    batch: GroupedBatch
    flat: Tensor
    packed: Tensor
    shape: tuple[int, int]

    def scatter(self, hidden: Tensor) -> Tensor:
        """Packed hidden states [1, T, H] -> the padded layout [n, L, H] (zeros on padding)."""
        n, L = self.shape
        h = hidden[0]
        out = h.new_zeros(n * L, h.shape[-1])
        return out.index_copy(0, self.flat.to(h.device), h.index_select(0, self.packed.to(h.device))).view(n, L, -1)


def pair_plan(input_ids: Tensor, attention_mask: Tensor) -> PairPlan | str:
    """Pack a TRL DPO batch as one prefix trie, or say why it cannot be packed.

    Every row's real tokens become one sequence of :meth:`GroupedBatch.from_sequences`: the chosen and
    rejected rows of a pair share their prompt, and rows that start alike across pairs (a repeated
    prompt, a common system prompt) share that too. Each real token's hidden state is its
    hidden state in the row run alone, so the plan does not depend on where the completion starts.

    Args:
        input_ids, attention_mask: [n, L] as TRL's DPO collator builds them: each row's real tokens
            from column 0, then right padding.

    Returns:
        a :class:`PairPlan`, or a string naming the reason the batch must take the stock path.
    """
    n, L = input_ids.shape
    ids = input_ids.detach().cpu()
    am = attention_mask.detach().cpu().bool()
    lens = am.sum(1)
    if not torch.equal(am, torch.arange(L)[None] < lens[:, None]):
        return "rows are not real tokens from column 0 followed by right padding"
    if (lens < 2).any():
        return "a row has fewer than 2 tokens (truncated away?)"
    batch = GroupedBatch.from_sequences([ids[r, :lens[r]] for r in range(n)])
    flat = torch.cat([r * L + torch.arange(int(lens[r])) for r in range(n)])
    return PairPlan(input_ids, batch, flat, torch.cat(batch.paths), (n, L))


def _why_stock(plan: PairPlan | str, model: torch.nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why this fused call must take TRL's stock forward (None: it can be grouped)."""
    if isinstance(plan, str):
        return plan
    if args or kwargs.get("input_ids") is not plan.input_ids:
        return "the model was called with other inputs than the batch's"
    extra = sorted(k for k, v in kwargs.items() if k not in _HANDLED and v is not None
                   and not any(v is n for n in _NEUTRAL.get(k, ())))
    if extra:
        return f"model inputs flexgroup does not pack: {extra}"
    if model.config.get_text_config() is not model.config:
        return "multimodal models go through the stock forward"
    return None


class FlexGroupDPOMixin:
    """Adds grouped (prompt-shared) decoder calls to a ``DPOTrainer`` (sub)class; see the module docstring."""

    # ------------------------------------------------------------------ setup
    def _flexgroup_setup(self, backend: str = "auto") -> None:
        """Patch the policy and reference models and wrap their fused forwards (idempotent)."""
        if getattr(self, "_flexgroup_ready", False):
            return
        mod = sys.modules[DPOTrainer.__module__]
        if not hasattr(mod, "add_fused_lm_head") or not hasattr(DPOTrainer, "_compute_loss"):
            raise NotImplementedError(
                "flexgroup's DPO adapter needs a TRL DPOTrainer whose forward uses the fused LM head "
                "(model(..., fused_lm_head=True), recent TRL releases); this TRL's DPOTrainer runs "
                "concatenated_forward over full logits instead. Upgrade TRL, or use the stock DPOTrainer")
        self.flexgroup_backend = backend
        self.flexgroup_stats: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._flexgroup_plan: PairPlan | str | None = None   # set while TRL computes a batch's loss
        self._flexgroup_warned: set[str] = set()
        for m in (self.model, getattr(self, "ref_model", None)):
            if m is None:
                continue
            m = self.accelerator.unwrap_model(m)
            flexgroup.patch(m, backend=backend)
            base = m.get_base_model() if callable(getattr(m, "get_base_model", None)) else m
            self._flexgroup_wrap(base)
        self._flexgroup_ready = True

    def _flexgroup_wrap(self, model: torch.nn.Module) -> None:
        """Wrap the forward TRL gave a fused LM head (an instance attribute, also called by PEFT)."""
        previous = model.forward
        if getattr(previous, "_flexgroup_dpo", False):
            return
        trainer = self

        @functools.wraps(previous)
        def forward(*args, **kwargs):
            plan = trainer._flexgroup_plan
            if plan is None or not kwargs.get("fused_lm_head"):
                return previous(*args, **kwargs)
            reason = _why_stock(plan, model, args, kwargs)
            if reason is not None:
                ids = plan.input_ids if isinstance(plan, PairPlan) else kwargs.get("input_ids")
                trainer._flexgroup_fallback(reason, ids)
                return previous(*args, **kwargs)
            return trainer._flexgroup_grouped_call(model, previous, plan, kwargs)

        forward._flexgroup_dpo = True
        model.forward = forward

    # ------------------------------------------------------------------ the grouped decoder call
    def _flexgroup_grouped_call(self, model, previous, plan: PairPlan, kwargs: dict):
        decoder = model.base_model
        calls = []

        def pre(module, args, kw):
            if args or calls:
                raise RuntimeError("flexgroup DPO adapter: TRL's fused forward called the decoder in an unexpected "
                                   "way (positional inputs or twice); please report it with your TRL version")
            calls.append(1)
            kw = dict(kw)
            kw.update(plan.batch.model_inputs(kw["input_ids"].device))
            return args, kw

        def post(module, args, output):
            output["last_hidden_state"] = plan.scatter(output["last_hidden_state"])
            return output

        h_pre = decoder.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)  # before flexgroup's guards
        h_post = decoder.register_forward_hook(post)
        try:
            out = previous(**kwargs)
        finally:
            h_pre.remove()
            h_post.remove()
        if not calls:
            raise RuntimeError(f"flexgroup DPO adapter: TRL's fused forward did not call {type(model).__name__}."
                               "base_model; this TRL version is not supported (use the stock DPOTrainer)")
        stats = self.flexgroup_stats["policy" if torch.is_grad_enabled() else "ref"]
        n, L = plan.shape
        stats["baseline_tokens"] += n * L
        stats["real_tokens"] += int(plan.flat.numel())
        stats["grouped_tokens"] += plan.batch.num_tokens
        stats["forwards"] += 1
        return out

    def _flexgroup_fallback(self, reason: str, input_ids: Tensor | None) -> None:
        if reason not in self._flexgroup_warned:
            self._flexgroup_warned.add(reason)
            warnings.warn(f"flexgroup: stock DPO forward ({reason}); exact, without sharing", stacklevel=4)
        role = "policy" if torch.is_grad_enabled() else "ref"
        self.flexgroup_stats[role]["fallback_tokens"] += int(input_ids.numel()) if input_ids is not None else 0

    @contextlib.contextmanager
    def _flexgroup_batch(self, inputs):
        """Plan the batch's grouping (or the reason not to) for the model calls made inside."""
        self._flexgroup_plan = pair_plan(inputs["input_ids"], inputs["attention_mask"])
        try:
            yield
        finally:
            self._flexgroup_plan = None

    # ------------------------------------------------------------------ TRL entry points
    def _compute_loss(self, model, inputs, return_outputs):
        with self._flexgroup_batch(inputs):
            return super()._compute_loss(model, inputs, return_outputs)

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        # TRL precomputes reference log-probs inside its __init__ (precompute_ref_log_probs=True): set up first
        self._flexgroup_setup(getattr(self, "flexgroup_backend", "auto"))
        return super()._precompute_ref_logps(dataset, name, batch_size)

    def compute_ref_log_probs(self, model, inputs):
        with self._flexgroup_batch(inputs):
            return super().compute_ref_log_probs(model, inputs)

    # one line per role: decoder tokens, grouped vs the stock forward (the GRPO adapter's report)
    flexgroup_report = FlexGroupMixin.flexgroup_report


class FlexGroupDPOTrainer(FlexGroupDPOMixin, DPOTrainer):
    """``trl.DPOTrainer`` with prompt-shared forwards; same arguments plus ``flexgroup_backend``.

    Args:
        flexgroup_backend: attention backend for :func:`flexgroup.patch` (``"auto"``: flex on CUDA,
            the exact lse backend on CPU).
    """

    def __init__(self, *args, flexgroup_backend: str = "auto", **kwargs):
        self.flexgroup_backend = flexgroup_backend
        super().__init__(*args, **kwargs)
        self._flexgroup_setup(flexgroup_backend)


def patch_dpo_trainer(trainer: DPOTrainer, backend: str = "auto") -> DPOTrainer:
    """Turn an existing ``DPOTrainer`` (or subclass) instance into a flexgroup one, in place; returns it."""
    if not isinstance(trainer, DPOTrainer):
        raise TypeError(f"patch_dpo_trainer expects a trl.DPOTrainer (or subclass), got {type(trainer).__name__}")
    mix_into(trainer, FlexGroupDPOMixin)
    trainer._flexgroup_setup(backend)
    return trainer
