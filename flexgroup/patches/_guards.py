"""Model-level guards: computations outside attention that a packed row would change silently.

Attention is made exact by the grouped mask; these are the other places where a model's numbers
depend on the *whole call* rather than on each token's own sequence. Each is made exact or refused
with an error that names the cause and the fix ("exact or loud"):

- **Position-dependent RoPE scaling.** ``rope_type="longrope"`` picks its short or long factors
  from ``max(position_ids) + 1`` of the whole call, ``"dynamic"`` NTK scaling its base from the
  same length. Run alone, each sequence of length ``n`` selects by its own ``n``. A packed row is
  exact when every sequence selects what the longest one selects (longrope: all ``n <=
  original_max_position_embeddings`` or all above; dynamic: all ``n <= max_position_embeddings``, or
  all sequences equally long); otherwise it is refused. The lengths are the batch's sequences
  (``GroupedMask.sequence_ends``), not the tree's leaves: a sequence may be a strict prefix of another.
- **Llama-4 attention temperature tuning** scales the queries of NoPE layers by the *physical*
  index ``p`` in the row (``log1p(floor((p + 1) / floor_scale))``), not the virtual position: a row
  is exact when every token's factor equals the one its virtual position gives; otherwise refused.
- **Random ops outside attention** (dropout as a module or a function, router jitter, any
  ``torch.rand``): the G responses would share one draw on the prompt instead of G independent
  ones. Refused unless ``flexgroup.patch(model, shared_prefix_dropout=True)`` accepts the shared
  draw; caught where they happen by :mod:`flexgroup.patches._random` (the random generators' state
  around the forward, and ``nn.Dropout`` modules named before it).
- **The language model's call** (:func:`grouped_inputs_hook`): the grouped mask and positions must
  arrive together and unchanged, no KV cache (:func:`~flexgroup.patches._interface.refuse_cache`),
  one packed row, virtual positions within ``max_position_embeddings``, flexgroup's attention in
  charge; Qwen-VL rows with visual placeholders need 3-row M-RoPE ids (:func:`visual_positions_guard`).
- **The causal-LM head** (a hook on the ``*ForCausalLM`` around the language model): ``labels=``
  would make transformers compute a loss across the packed row, an integer ``logits_to_keep``
  would keep the row's last positions (not the rows ``batch.logprobs`` reads), and
  ``model.generate`` cannot take a packed row: each is refused. The MoE load-balancing loss
  (``output_router_logits=True``) reads ``attention_mask`` as per-token weights: grouped inputs give
  it the number of the batch's sequences through each token (a strict prefix or a duplicate counts
  too), so ``aux_loss`` equals the baseline's over the padded batch of every sequence.

Config facts are read once per patched model (:class:`ModelGuards`); the per-forward checks are a
few integer comparisons over the batch's sequence lengths, a loop over the model's dropout modules
(found once) and two reads of the random generators' state.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from flexgroup.data.carrier import GroupedMask, tagged_layout
from flexgroup.layout import Layout

from . import _random
from ._interface import SEQUENCE_PARALLEL, is_flexgroup_name, refuse_cache
from ._random import dropout_modules

__all__ = ["ModelGuards", "guards_of", "dropout_modules", "sequence_weights", "install", "uninstall", "CARRIER",
           "grouped_inputs_hook", "visual_positions_guard", "check_grouped_call"]

ATTR = "_flexgroup_guards"  # attribute on the language model
# attributes on the wrapper: the language model (not a registered submodule), the hook's handle, and the
# (text) config that holds output_router_logits (MoE models; else None)
LM, HOOK, ROUTER = "_flexgroup_lm", "_flexgroup_head_hook", "_flexgroup_router_config"
CARRIER = "_flexgroup_carrier"  # attribute of the MoE weights tensor that carries the GroupedMask through


def rope_field(config) -> str:
    """The config attribute that holds the RoPE parameters: ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` (4.x)."""
    return "rope_parameters" if isinstance(getattr(config, "rope_parameters", None), dict) else "rope_scaling"


def _rope_sets(config) -> list[dict]:
    """The config's RoPE parameter dicts (one, or one per layer type)."""
    rp = getattr(config, rope_field(config), None)
    if not isinstance(rp, dict):
        return []
    if "rope_type" in rp or "type" in rp:
        return [rp]
    return [v for v in rp.values() if isinstance(v, dict)]


@dataclass
class ModelGuards:
    """What one patched language model needs checked on each grouped forward.

    Attributes:
        longrope: ``original_max_position_embeddings`` of each longrope parameter set.
        dynamic: ``max_position_embeddings`` when a RoPE set uses dynamic NTK scaling (else None).
        temperature_floor: Llama-4 ``floor_scale`` when temperature tuning acts on NoPE layers.
        rope_field: the config attribute holding the RoPE parameters (named in errors).
        shared_prefix_dropout: the user accepts one dropout mask on shared tokens (no dropout check).
    """

    longrope: tuple[int, ...] = ()
    dynamic: int | None = None
    temperature_floor: int | None = None
    shared_prefix_dropout: bool = False
    rope_field: str = "rope_parameters"
    _dropouts: dict = field(default_factory=dict, repr=False, compare=False)  # role -> (structure, modules)

    @classmethod
    def from_config(cls, config) -> "ModelGuards":
        longrope, dynamic = [], None
        mpe = getattr(config, "max_position_embeddings", None)
        for rp in _rope_sets(config):
            kind = str(rp.get("rope_type", rp.get("type", "default")))
            if kind == "longrope":
                omp = rp.get("original_max_position_embeddings") or getattr(
                    config, "original_max_position_embeddings", None) or mpe
                if omp:
                    longrope.append(int(omp))
            elif "dynamic" in kind and mpe:  # transformers' test: `"dynamic" in rope_type`
                dynamic = int(mpe)
        floor = None
        nope = [not bool(x) for x in (getattr(config, "no_rope_layers", None) or [])]
        if getattr(config, "attn_temperature_tuning", False) and any(nope):
            floor = int(config.floor_scale)
        return cls(tuple(sorted(set(longrope))), dynamic, floor, rope_field=rope_field(config))

    def rope_scalings(self) -> list[tuple[str, int]]:
        """``(what, threshold)`` of each length-dependent RoPE scaling: past ``threshold`` tokens a sequence's
        factors depend on the length of the forward it runs in."""
        field = f"config.{self.rope_field}"
        out = [(f"rope_type='longrope' in {field} (long factors past original_max_position_embeddings={n})", n)
               for n in self.longrope]
        if self.dynamic:
            out.append((f"rope_type='dynamic' in {field} (NTK scaling recomputed from the longest position of the "
                        f"forward past max_position_embeddings={self.dynamic})", self.dynamic))
        return out

    def check(self, layout: Layout, where: str, ends: tuple[int, ...] | None = None) -> None:
        """ValueError naming the cause and the fix if the row is not exact for this model.

        ``ends``: the batch's sequences (``GroupedMask.sequence_ends``); default the layout's leaves."""
        if self.longrope or self.dynamic:
            lens = layout.sequence_lengths(ends)
            longest = max(lens)
            for omp in self.longrope:
                if min(lens) <= omp < longest:
                    short = sum(n <= omp for n in lens)
                    raise ValueError(
                        f"{where}: rope_type='longrope' (config.{self.rope_field}) picks its short or long factors "
                        f"from each sequence's length (long above original_max_position_embeddings={omp}), but this packed row holds "
                        f"{short} sequence(s) of <= {omp} tokens and {len(lens) - short} longer (up to {longest}): "
                        "in one call every sequence would get the long factors. Pack sequences on one side of "
                        f"{omp} tokens per row (e.g. split the batch by prompt + response length)")
            if self.dynamic and longest > self.dynamic and min(lens) != longest:
                raise ValueError(
                    f"{where}: rope_type='dynamic' (NTK, config.{self.rope_field}) rescales RoPE from each "
                    f"sequence's length once it exceeds max_position_embeddings={self.dynamic}; this packed row holds sequences of {min(lens)} to "
                    f"{longest} tokens, so one call cannot give each its own scaling. Keep sequences within "
                    f"{self.dynamic} tokens, or pack only equally long sequences in a row")
        floor = self.temperature_floor
        if floor is not None and layout.num_tokens >= floor:
            phys = torch.arange(layout.num_tokens)
            virt = layout.position_ids
            if not torch.equal(torch.div(phys + 1, floor, rounding_mode="floor"),
                               torch.div(virt + 1, floor, rounding_mode="floor")):
                raise ValueError(
                    f"{where}: attention temperature tuning (attn_temperature_tuning=True, floor_scale={floor}) "
                    "scales the queries of NoPE layers by each token's index in the packed row, not its position "
                    f"in its own sequence, and this row of {layout.num_tokens} tokens crosses floor_scale: "
                    f"pack fewer than {floor} tokens per row (e.g. GroupedBatch.micro_batches with a budget "
                    f"< {floor}), or only one sequence per row")

    def check_dropout(self, root: torch.nn.Module, skip: torch.nn.Module | None, where: str) -> None:
        """RuntimeError naming the dropout modules under ``root`` (``skip``'s subtree excluded) with ``p > 0``
        in training mode, unless ``shared_prefix_dropout``."""
        if self.shared_prefix_dropout:
            return
        role = "outer" if skip is not None else "inner"
        version = _random.structure_version()
        cached = self._dropouts.get(role)
        if cached is None or version is None or cached[0] != version:
            cached = self._dropouts[role] = (version, dropout_modules(root, skip))
        names = [name for name, m in cached[1] if m.training and m.p > 0]
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise RuntimeError(
                f"{where}: dropout is active in training mode on the token path ({shown}): with grouped inputs the "
                "responses of a group would share one dropout mask on their prompt, where the repeated baseline "
                "draws an independent mask per response. Set the dropout probabilities to 0 (e.g. LoRA "
                "lora_dropout=0, config.resid_pdrop / embd_pdrop = 0), call model.eval(), or accept the shared "
                "mask explicitly with flexgroup.patch(model, shared_prefix_dropout=True)")


def guards_of(lm: torch.nn.Module) -> ModelGuards:
    """The language model's :class:`ModelGuards` (read from its config on first use)."""
    g = lm.__dict__.get(ATTR)
    if g is None:
        g = ModelGuards.from_config(lm.config)
        lm.__dict__[ATTR] = g
    return g


def sequence_weights(mask: GroupedMask) -> torch.Tensor:
    """FloatTensor [L] on CPU: how many of the batch's sequences contain each token of the row."""
    return mask.sequence_counts().to(torch.float32)


# ------------------------------------------------------------------------------- causal-LM head
def head_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook on the ``*ForCausalLM`` (or VL / classifier) wrapper around a patched language model."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if not isinstance(mask, GroupedMask):
        return None
    name = type(module).__name__
    if kwargs.get("labels") is not None:
        raise ValueError(
            f"{name}: labels= with grouped inputs would make transformers compute its loss across the packed row "
            "(the last token of one response 'predicting' the first of the next, each prompt counted once). "
            "Drop labels and compute the loss from lp = batch.logprobs(out.logits) with batch.response_mask "
            "(e.g. flexgroup.train.grpo.policy_loss); -(lp * mask).sum() / mask.sum() is the baseline's token-mean NLL")
    keep = kwargs.get("logits_to_keep")
    if isinstance(keep, int) and keep != 0:
        raise ValueError(
            f"{name}: logits_to_keep={keep} keeps the last {keep} rows of the packed row, not the rows "
            "batch.logprobs reads. Use batch.model_inputs(needed_logits_only=True) (it passes logits_to_keep="
            "batch.logit_rows), or logits_to_keep=0")
    for k in ("past_key_values", "cache", "past_key_value"):
        if kwargs.get(k) is not None:
            refuse_cache(name, f"{k}= was passed", k)
    lm = module.__dict__[LM]
    guards_of(lm).check_dropout(module, lm, name)  # the language model's own hook scans inside it
    router = kwargs.get("output_router_logits")
    if router is None and module.__dict__[ROUTER] is not None:
        router = module.__dict__[ROUTER].output_router_logits
    if router and mask.shard is not None:
        raise ValueError(f"{name}: output_router_logits with sequence parallelism: the MoE load-balancing loss "
                         "would be computed from each rank's slice, not the whole row; pass output_router_logits=False "
                         "(and add the aux loss from an unsharded forward if you need it)")
    if router:
        # MoE load-balancing loss: attention_mask is read as per-token weights [1, L]; each token counts
        # once per sequence through it, as in the padded baseline. The language model's hook puts the
        # GroupedMask back before anything else sees this tensor.
        w = sequence_weights(mask).to(mask.device)[None]
        setattr(w, CARRIER, mask)
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = w
        else:
            args = args[:1] + (w,) + args[2:]
        return args, kwargs
    return None


def _rng_before(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """First pre-hook on the language model and its wrapper: watch the generators during a grouped call."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    grouped = isinstance(mask, GroupedMask) or getattr(mask, CARRIER, None) is not None
    _random.begin(module, grouped and not guards_of(module.__dict__.get(LM, module)).shared_prefix_dropout)


def _rng_after(module: torch.nn.Module, args: tuple, kwargs: dict, output) -> None:
    _random.end(module)


@contextmanager
def watched_outside_forward(base: torch.nn.Module, module: torch.nn.Module, where: str):
    """Around a call of ``module``, a part of the patched ``base`` that streaming runs outside ``base``'s own
    forward (the vision tower, once per distinct image): the checks of a grouped forward of ``base`` -- its
    active dropout modules refused by name, then the generator watch (RuntimeError if a draw happened) --
    unless ``patch(..., shared_prefix_dropout=True)``."""
    lm = base.__dict__.get(LM, base)
    guards_of(lm).check_dropout(base, lm if lm is not base else None, where)
    _random.begin(module, not guards_of(lm).shared_prefix_dropout)
    try:
        yield
    except BaseException:
        module.__dict__.pop(_random.STATE, None)
        raise
    _random.end(module)


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


class _GenerateGuard:
    """``model.generate`` of a patched model: refuses grouped inputs, else the model's own ``generate``."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        if any(isinstance(v, GroupedMask) for v in list(args) + list(kwargs.values())) or \
                tagged_layout(kwargs.get("position_ids")) is not None:
            raise ValueError(
                f"{type(self.model).__name__}.generate got grouped inputs (batch.model_inputs()): a packed row is "
                "for scoring and training (no KV cache, several sequences in one row). Generate from ordinary "
                "inputs (e.g. the tokenizer's input_ids / attention_mask); the patched model generates normally")
        return type(self.model).generate(self.model, *args, **kwargs)


def install(base: torch.nn.Module, lm: torch.nn.Module, shared_prefix_dropout: bool) -> None:
    """Attach guards to a patched model (idempotent; updates ``shared_prefix_dropout``)."""
    guards_of(lm).shared_prefix_dropout = bool(shared_prefix_dropout)
    _random.watch(lm, _rng_before, _rng_after)
    if base is lm or HOOK in base.__dict__:
        return
    _random.watch(base, _rng_before, _rng_after)
    base.__dict__[LM] = lm
    text = _text_config(base.config)
    base.__dict__[ROUTER] = next((c for c in (base.config, text) if hasattr(c, "output_router_logits")), None)
    base.__dict__[HOOK] = base.register_forward_pre_hook(head_hook, with_kwargs=True)  # a RemovableHandle
    if callable(getattr(type(base), "generate", None)):
        base.__dict__["generate"] = _GenerateGuard(base)


def uninstall(base: torch.nn.Module, lm: torch.nn.Module) -> None:
    """Remove what :func:`install` attached."""
    handle = base.__dict__.pop(HOOK, None)
    if handle is not None:
        handle.remove()
    base.__dict__.pop(LM, None)
    base.__dict__.pop(ROUTER, None)
    if isinstance(base.__dict__.get("generate"), _GenerateGuard):
        del base.__dict__["generate"]
    _random.unwatch(base)
    _random.unwatch(lm)
    lm.__dict__.pop(ATTR, None)


# ------------------------------------------------------------------------------- the language model
def check_grouped_call(layout: Layout, max_positions: int | None, model_type: str) -> None:
    if max_positions is not None and layout.max_position >= max_positions:
        raise ValueError(
            f"grouped inputs reach virtual position {layout.max_position}, but the {model_type} model "
            f"supports positions < {max_positions} (config.max_position_embeddings): shorten the prompt "
            "or responses, or split the batch"
        )


def grouped_inputs_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook on the patched language model: model-level guards for grouped inputs.

    Runs the checks of this module (position-dependent RoPE scaling, Llama-4
    temperature tuning, dropout) once per forward, puts back the grouped mask that the causal-LM
    wrapper's hook carried through the MoE aux-loss weights, and starts a new forward on the carrier
    (its plans are rebuilt once, then shared by the layers).
    """
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    carried = getattr(mask, CARRIER, None)  # MoE aux-loss weights from the causal-LM wrapper's hook
    if carried is not None:
        mask = carried
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = mask
        else:
            args = args[:1] + (mask,) + args[2:]
    pos = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    tagged = tagged_layout(pos)
    config = module.config
    name = type(module).__name__
    if not isinstance(mask, GroupedMask):
        if tagged is not None:
            raise ValueError(
                f"{name} got grouped position_ids (from GroupedBatch.model_inputs) with attention_mask of type "
                f"{type(mask).__name__}: a user attention_mask replaces the grouped layout and would give wrong "
                "numbers. Pass batch.model_inputs() unchanged (its attention_mask carries the layout)"
            )
        return None
    layout = mask.grouped_layout
    if mask.shard is not None and getattr(module, SEQUENCE_PARALLEL, None) is None:
        raise ValueError(f"{name} got sharded inputs (batch.model_inputs(shard=group)) but was patched without "
                         "sequence parallelism: call flexgroup.patch(model, sequence_parallel=group), same group")
    impl = getattr(config, "_attn_implementation", None)
    if not is_flexgroup_name(impl):
        raise RuntimeError(
            f"{name} got grouped inputs but its attention implementation is {impl!r}, not flexgroup's: "
            "flash / sdpa / eager kernels ignore the grouped layout. Call flexgroup.patch(model) again "
            "after switching implementations"
        )
    for k in ("cache", "past_key_values"):
        if kwargs.get(k) is not None:
            refuse_cache(name, f"{k}= was passed", k)
    use_cache = kwargs.get("use_cache")
    if use_cache or (use_cache is None and getattr(config, "use_cache", False)):
        refuse_cache(name, f"use_cache={use_cache!r}")
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if ids is not None and (ids.shape[0] != 1 or ids.shape[1] != mask.local_tokens):
        raise ValueError(f"{name}: grouped inputs must be one packed row of {mask.local_tokens} tokens, got "
                         f"input of shape {tuple(ids.shape)}")
    if pos is None:
        raise ValueError(f"{name}: grouped inputs need their virtual position_ids (batch.model_inputs() gives "
                         "them); without them RoPE would use physical positions")
    if tagged is not layout and mask.shard is None:  # sharded: checked by patches/sequence_parallel.py
        if pos.shape[-1] != layout.num_tokens or not torch.equal(pos.reshape(-1, pos.shape[-1])[0].cpu(),
                                                                 layout.position_ids):
            raise ValueError(f"{name}: position_ids do not match the grouped layout's virtual positions")
    guards = guards_of(module)
    guards.check(layout, name, mask.sequence_ends)
    guards.check_dropout(module, None, name)
    check_grouped_call(layout, getattr(config, "max_position_embeddings", None), config.model_type)
    mask.new_forward()
    return (args, kwargs) if carried is not None else None


def visual_positions_guard(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Grouped inputs with visual placeholders need 3-row M-RoPE ids (a MultimodalGroupedBatch)."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if not isinstance(mask, GroupedMask):
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    pos = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    if pos is not None and pos.ndim == 3 and pos.shape[0] in (3, 4):  # [text;] t, h, w
        return None  # M-RoPE ids: nothing to check, and no host sync on the ids (found by the fake-CUDA trace)
    cfg = module.config
    visual = ids is not None and bool(((ids == cfg.image_token_id) | (ids == cfg.video_token_id)).any())
    if visual:
        raise ValueError(
            f"{type(module).__name__} got grouped inputs with image/video placeholders but position_ids of shape "
            f"{None if pos is None else tuple(pos.shape)}: visual tokens need 3-row M-RoPE ids. Build the batch "
            "with flexgroup.data.multimodal.MultimodalGroupedBatch.from_groups(..., model=model, vision=...)")
    return None
