"""verl 0.9's FSDP actor with shared-prefix (grouped) forwards: one config switch, exact log-probs.

Enabled by ``actor_rollout_ref.model.external_lib=flexgroup.integrations.verl`` (a verl external module,
imported by every worker before it builds its engine). Importing this module registers
:class:`FlexGroupFSDPEngine` as verl's ``language_model`` engine for the ``fsdp`` / ``fsdp2`` backends;
:func:`unregister` restores verl's. The engine is ``FSDPEngineWithLMHead`` whose ``forward_step`` runs a
micro-batch as one packed row with every common prefix encoded once (a token-level trie,
:meth:`flexgroup.GroupedBatch.from_padded` with ``share="trie"``) and returns verl's own jagged
``log_probs`` / ``entropy`` / ``sum_pi_squared``, value for value, so verl's loss runs unchanged.
``forward_backward_batch`` re-plans the mini-batch by trie under verl's token budget
(:mod:`~flexgroup.integrations.verl_batch`; a trie bigger than the budget is streamed,
:mod:`~flexgroup.integrations.verl_stream`); Ulysses runs grouped over verl's SP group
(:mod:`~flexgroup.integrations.verl_ulysses`). Qwen-VL micro-batches (``multi_modal_inputs``, ``[N, 4, n_i]``
M-RoPE ``position_ids``) run as one :class:`~flexgroup.MultimodalGroupedBatch`, each distinct image encoded once
per forward (:mod:`~flexgroup.integrations.verl_vision`). A mode that cannot be grouped exactly runs verl's stock step
with one warning naming it (:func:`fallback_reason`). What each step does, what falls back and why, and how
it is tested: docs/verl.md.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import torch

try:
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode
    from verl.utils.device import get_device_id, get_device_name
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine.utils import detach_tree
except ImportError as e:  # pragma: no cover - exercised only without verl
    raise ImportError('flexgroup.integrations.verl needs verl 0.9: pip install -e ".[verl]" in the flexgroup clone') from e

import flexgroup
from flexgroup import GroupedBatch, MultimodalGroupedBatch
from flexgroup.patches import is_flash_style, is_patched

from .verl_batch import plan_refusal, whole_batch_step
from .verl_readout import model_output
from .verl_ulysses import sharded_outputs
from .verl_vision import (is_vision_batch, multimodal_batch, restore_attention, vision_patches,
                          vision_reason, vl_model_inputs)

__all__ = ["FlexGroupFSDPEngine", "TokenStats", "register", "unregister", "grouped_batch", "fallback_reason",
           "BACKENDS"]

Tensor = torch.Tensor
BACKENDS = ("fsdp", "fsdp2")  # verl backends whose language-model engine this module replaces
_REPLACED: dict[tuple[str, object], type] = {}


@dataclass
class TokenStats:
    """Tokens through the model, summed over grouped micro-batches (``engine.flexgroup_stats``).

    Attributes:
        sequences: samples run grouped.
        real_tokens: their real (non-padding) tokens: what verl's stock step feeds the model with
            ``use_remove_padding=True``.
        padded_tokens: samples x longest sample, per micro-batch: the stock step without remove-padding.
        grouped_tokens: tokens of the packed rows flexgroup ran instead.
        fallback_micro_batches: micro-batches that ran verl's stock step (a mode named in a warning).
        forwards: grouped forwards run (planned forwards, or verl's micro-batches where they are kept, and
            streamed forwards).
        streamed_tries: prefix tries bigger than the token budget that were streamed
            (:mod:`flexgroup.integrations.verl_stream`).
        streamed_forwards: model forwards those streams ran (included in ``forwards``).
        vision_patches: patch rows (``pixel_values`` + ``pixel_values_videos``) verl's stock step gives the
            vision tower: every sample's own copy of its images.
        grouped_vision_patches: patch rows the grouped forwards gave it (each distinct image once per forward).
    """

    sequences: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    grouped_tokens: int = 0
    fallback_micro_batches: int = 0
    forwards: int = 0
    streamed_tries: int = 0
    streamed_forwards: int = 0
    vision_patches: int = 0
    grouped_vision_patches: int = 0


def fallback_reason(engine: FSDPEngineWithLMHead, mb) -> str | None:
    """Why this micro-batch must run verl's stock step, or None when it can be grouped exactly."""
    get = lambda key, default=None: tu.get_non_tensor_data(data=mb, key=key, default=default)  # noqa: E731
    refused = getattr(engine, "_flexgroup_patch_error", None)
    if refused is not None:
        return f"a model flexgroup.patch refuses ({type(refused).__name__}: {refused})"
    if get("use_fused_kernels", False):
        return "use_fused_kernels=True: verl's fused kernels compute log-probs inside the model"
    if get("distillation_use_topk", False):
        return "top-k distillation: teacher tensors follow verl's packed token order"
    if get("pad_mode", DatasetPadMode.NO_PADDING) != DatasetPadMode.NO_PADDING:
        return f"pad_mode={get('pad_mode')!r}"
    if "routed_experts" in mb.keys():
        return "MoE routing replay (routed_experts): routing follows verl's packed token order"
    ids, pos = mb["input_ids"], mb["position_ids"]
    if not getattr(ids, "is_nested", False) or not getattr(pos, "is_nested", False):
        return "input_ids / position_ids are not jagged (nested) tensors"
    if is_vision_batch(mb):  # checked further by multimodal_batch (M-RoPE ids against the model's own)
        model = getattr(engine, "module", None)
        return vision_reason(getattr(model, "_fsdp_wrapped_module", model), mb,
                             bool(getattr(engine, "use_ulysses_sp", False)))
    offsets = ids.offsets()
    lens = offsets.diff()
    if bool((lens == 0).any()):
        return "an empty sample"
    owner = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    expect = torch.arange(int(offsets[-1]), device=lens.device) - offsets[:-1][owner]
    if pos.values().shape != expect.shape or not torch.equal(pos.values().to(expect.device), expect):
        return "position_ids that do not count 0..n-1 within each sample"
    return None


def grouped_batch(mb) -> GroupedBatch:
    """The micro-batch's samples packed as one prefix trie; ``paths[i]`` is sample ``i``'s tokens.

    Built from verl's left-padded ``prompts``, right-padded ``responses`` and ``attention_mask``
    (:meth:`GroupedBatch.from_padded`, ``share="trie"``) when the micro-batch carries them, else from
    the jagged ``input_ids`` alone (e.g. an SFT batch). ValueError if the packed sequences are not
    exactly the micro-batch's ``input_ids``.
    """
    ids = mb["input_ids"]
    values, lens = ids.values().cpu(), ids.offsets().diff().cpu()
    batch = None
    if "prompts" in mb.keys() and "responses" in mb.keys() and "attention_mask" in mb.keys():
        p, r, am = mb["prompts"], mb["responses"], mb["attention_mask"]
        if not (p.is_nested or r.is_nested or am.is_nested) and am.shape[1] == p.shape[1] + r.shape[1]:
            pm, rm = am[:, :p.shape[1]].cpu(), am[:, p.shape[1]:].cpu()
            if bool((pm.sum(1) > 0).all()) and bool((rm.sum(1) > 0).all()):
                batch = GroupedBatch.from_padded(p.cpu(), pm, r.cpu(), rm, share="trie")
    if batch is None:
        batch = GroupedBatch.from_sequences(list(values.split(lens.tolist())))
    if not torch.equal(batch.input_ids[torch.cat(batch.paths)], values):
        raise ValueError("prompts / responses disagree with input_ids")
    return batch


class FlexGroupFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP language-model engine whose forwards run grouped, planned over the whole mini-batch.

    Class attribute ``flexgroup_plan_whole_batch`` (default True): False keeps verl's micro-batches (each
    still grouped). Class attribute ``flexgroup_backend``: the kernel backend given to :func:`flexgroup.patch`
    (``"auto"``: FlexAttention on CUDA, the exact lse backend on CPU). The model is patched on the
    first grouped step; ungrouped inputs (stock fallbacks) still reach the model's own attention.
    """

    flexgroup_backend: str = "auto"
    flexgroup_plan_whole_batch: bool = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.flexgroup_stats = TokenStats()
        self._flexgroup_warned: set[str] = set()
        self._flexgroup_planning = False

    # ------------------------------------------------------------------ plumbing
    def _build_module(self):
        """verl's model build, with ``sdpa`` in place of a flash-attention implementation (verl's default
        ``flash_attention_2``): flash kernels take no custom mask, so flexgroup cannot patch them. Both
        are exact attention; ungrouped fallbacks then run sdpa too. Under Ulysses sequence parallelism too:
        grouped steps run flexgroup's own all-to-alls around its kernel (verl's Ulysses patch is for flash)."""
        cfg = self.model_config.hf_config
        impl = getattr(cfg, "_attn_implementation", None) or "sdpa"
        if is_flash_style(impl):
            warnings.warn(f"flexgroup: attn_implementation={impl!r} takes no custom mask; this engine builds the "
                          "model with 'sdpa' instead (exact attention either way). Set "
                          "actor_rollout_ref.model.override_config.attn_implementation=sdpa to say so.", stacklevel=2)
            cfg._attn_implementation = "sdpa"
        return super()._build_module()

    def _build_model_optimizer(self):
        """verl's build, then :meth:`_flexgroup_patch` on every rank at once (see there)."""
        super()._build_model_optimizer()
        self._flexgroup_patch_error = None
        try:
            self._flexgroup_patch()
        except (ValueError, TypeError, NotImplementedError) as e:  # flexgroup.patch refused this model
            if self.use_ulysses_sp:  # no exact stock step to fall back to (see _flexgroup_stock): say so now
                raise RuntimeError(
                    f"flexgroup: flexgroup.patch refused this model under Ulysses sequence parallelism "
                    f"(ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size}): {e}. verl's stock "
                    "Ulysses step needs flash attention, which this engine replaces with sdpa, so it cannot fall "
                    "back. Apply the fix named, or set ulysses_sequence_parallel_size=1 (the engine then runs verl's "
                    "stock step for this model, with one warning), or unregister flexgroup's engine "
                    "(flexgroup.integrations.verl.unregister()).") from e
            self._flexgroup_patch_error = e  # every step runs verl's stock step (fallback_reason names it)

    def _flexgroup_stock(self, reason: str, micro_batch, loss_function, forward_only):
        if self.use_ulysses_sp:
            raise RuntimeError(
                f"flexgroup: this micro-batch cannot be grouped ({reason}) and verl's stock step cannot run it "
                f"under Ulysses sequence parallelism (ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size}) "
                "here: verl's Ulysses attention is a flash-attention patch, and this engine builds the model with sdpa "
                "for flexgroup's own sequence parallelism, so the stock step would attend within each rank's slice "
                "only. Remove the cause named, or set ulysses_sequence_parallel_size=1, or unregister flexgroup's "
                "engine (flexgroup.integrations.verl.unregister()).")
        if reason not in self._flexgroup_warned:
            self._flexgroup_warned.add(reason)
            warnings.warn(f"flexgroup: verl's stock forward for {reason} (exact, without sharing)", stacklevel=3)
        self.flexgroup_stats.fallback_micro_batches += 1
        return super().forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)

    def _flexgroup_patch(self) -> None:
        """Patch the transformers model (inside FSDP1's wrapper; FSDP2 keeps the model's class), with
        sequence parallelism over verl's Ulysses group where it has one. Done right after the build, on
        every rank together: the generic path's self-check (models outside the registry) all-gathers
        the sharded weights into an unsharded copy, a collective that a step-time patch could reach on
        one rank only (a rank whose first micro-batch falls back). The forward still goes through
        ``self.module``, so FSDP gathers the parameters as in verl's step."""
        if getattr(self, "_flexgroup_patch_error", None) is not None:
            raise self._flexgroup_patch_error
        model = self._flexgroup_model()
        if not is_patched(model):
            group = self.ulysses_parallel_group if self.use_ulysses_sp else None
            flexgroup.patch(model, backend=self.flexgroup_backend, sequence_parallel=group)
            restore_attention(model)  # Qwen-VL under use_remove_padding: verl's flash forward takes no mask

    def _flexgroup_model(self) -> torch.nn.Module:
        """The transformers model (inside FSDP1's wrapper; FSDP2 keeps the model's class)."""
        return getattr(self.module, "_fsdp_wrapped_module", self.module)

    # ------------------------------------------------------------------ the step
    def forward_step(self, micro_batch, loss_function, forward_only):
        """verl's ``forward_step`` contract: returns ``(loss, {"model_output", "loss", "metrics"})``."""
        micro_batch = micro_batch.to(get_device_id())
        reason = fallback_reason(self, micro_batch)
        batch = None
        if reason is None:
            try:
                batch = (multimodal_batch(micro_batch, self._flexgroup_model()) if is_vision_batch(micro_batch)
                         else grouped_batch(micro_batch))
            except ValueError as e:
                reason = str(e)
        if reason is not None:
            return self._flexgroup_stock(reason, micro_batch, loss_function, forward_only)
        if not self._flexgroup_planning:  # a planned forward: the stock counts come from verl's micro-batches
            lens = micro_batch["input_ids"].offsets().diff()
            st = self.flexgroup_stats
            st.sequences += lens.numel()
            st.real_tokens += int(lens.sum())
            st.padded_tokens += lens.numel() * int(lens.max())
            st.vision_patches += vision_patches(micro_batch)
        return self._flexgroup_run(micro_batch, batch, loss_function, forward_only)

    def _flexgroup_run(self, micro_batch, batch: GroupedBatch, loss_function, forward_only):
        """One grouped forward of ``batch`` (the samples of ``micro_batch``) and verl's loss on it."""
        self._flexgroup_patch()
        self.flexgroup_stats.grouped_tokens += batch.num_tokens
        self.flexgroup_stats.forwards += 1
        if isinstance(batch, MultimodalGroupedBatch):
            self.flexgroup_stats.grouped_vision_patches += sum(
                int(batch.vision_inputs[k].shape[0]) for k in ("pixel_values", "pixel_values_videos")
                if k in batch.vision_inputs)
        ids = micro_batch["input_ids"]
        device_name = get_device_name()
        autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        autocast_ctx = (nullcontext() if autocast_dtype == torch.float32
                        else torch.autocast(device_type=device_name, dtype=autocast_dtype))
        with autocast_ctx:
            if self.use_ulysses_sp:
                model_output = sharded_outputs(self, batch, micro_batch, self.ulysses_parallel_group)
            else:
                device = ids.values().device
                inputs = (vl_model_inputs(batch, device) if isinstance(batch, MultimodalGroupedBatch)
                          else batch.model_inputs(device))
                logits = self.module(**inputs).logits[0]                                     # [L, V]
                model_output = self._flexgroup_outputs(logits, batch, micro_batch)
            if loss_function is not None:
                loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                              dp_group=self.get_data_parallel_group())
            else:
                assert forward_only, "forward_only must be True when loss_function is None"
                loss, metrics = torch.tensor(1.0, device=device_name), {}
        return loss, {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}

    # ------------------------------------------------------------------ the whole mini-batch (verl_batch)
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        """verl's ``forward_backward_batch``, planning the whole mini-batch (:mod:`.verl_batch`): samples are
        re-partitioned by prefix trie into forwards under verl's per-GPU token budget, and every output
        returns in verl's micro-batches, order and layout. Keeps verl's micro-batches (each still run
        grouped) for a mode that needs them -- one warning naming it -- or when
        ``flexgroup_plan_whole_batch`` is False."""
        if not self.flexgroup_plan_whole_batch or fallback_reason(self, data) is not None:
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)  # warns per mode
        if is_vision_batch(data):
            try:  # M-RoPE ids that are not the model's own: verl's own micro-batches, each stock (bit-identical)
                multimodal_batch(data, self._flexgroup_model())
            except ValueError:
                return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        reason = plan_refusal(loss_function, data)
        if reason is not None:
            self._flexgroup_warn_once(reason, f"flexgroup: {reason}; keeping verl's micro-batches (grouped within "
                                              "each, exact; no sharing across them)")
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)  # verl's preamble, as in its step
        batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
        torch.distributed.all_reduce(batch_num_tokens, op=torch.distributed.ReduceOp.SUM,
                                     group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item(), dp_size=self.get_data_parallel_size())
        self._flexgroup_planning = True
        try:
            return whole_batch_step(self, data, loss_function, forward_only)
        finally:
            self._flexgroup_planning = False

    def _flexgroup_warn_once(self, key: str, message: str) -> None:
        if key not in self._flexgroup_warned:
            self._flexgroup_warned.add(key)
            warnings.warn(message, stacklevel=3)

    def _flexgroup_outputs(self, logits: Tensor, batch: GroupedBatch, mb) -> dict[str, Tensor]:
        """verl's ``model_output`` from the packed row's logits [L, V] (:func:`.verl_readout.model_output`)."""
        return model_output(self, logits, batch, mb)


def register() -> None:
    """Make :class:`FlexGroupFSDPEngine` verl's ``language_model`` engine for the fsdp / fsdp2 backends
    (every device the stock engine is registered for). Called on import; idempotent."""
    engines = EngineRegistry._engines.get("language_model", {})
    for backend in BACKENDS:
        for key, cls in list(engines.get(backend, {}).items()):
            if cls is not FlexGroupFSDPEngine:
                _REPLACED[backend, key] = cls
                engines[backend][key] = FlexGroupFSDPEngine


def unregister() -> None:
    """Give verl back its own engines (undo :func:`register`)."""
    engines = EngineRegistry._engines.get("language_model", {})
    for (backend, key), cls in _REPLACED.items():
        engines[backend][key] = cls
    _REPLACED.clear()


register()
