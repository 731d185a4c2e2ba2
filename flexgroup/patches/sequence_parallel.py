"""``flexgroup.patch(model, sequence_parallel=group)``: Ulysses sequence parallelism over packed rows.

Each rank of ``group`` runs the model on its contiguous slice of the padded row
(``batch.model_inputs(shard=group)``, see :mod:`flexgroup.data.sharding`). Everything token-wise (embeddings,
projections, norms, MLPs, the LM head) runs on the slice; what mixes tokens runs on whole rows of a
share of the heads, between two all-to-alls (:mod:`flexgroup.kernels.ulysses`):

- **attention** (:func:`flexgroup.patches._interface.flexgroup_attention`): q/k/v of the slice go to
  head shards, flexgroup's kernel runs on the whole padded layout for ``Hq / W`` heads, the output
  comes back to the slice. KV heads that do not divide by ``W`` are replicated (exact).
- **Gated DeltaNet / Mamba2 mixers** (hybrids): the module-level functions that the stock mixer calls
  and that :mod:`flexgroup.patches.hybrid` already wraps for state forking get an outer wrapper here.
  The depthwise causal convolution goes to channel shards (every token of a channel on one rank), the
  gated delta rule / Mamba2 scan to head shards (every token of a head on one rank; GDN key heads and
  Mamba2 B/C groups replicated where they do not divide by ``W``); inside, the state forking runs
  unchanged on the whole row, then the result returns to the slice. Per mixer: two all-to-alls around
  the conv and two around the scan (the stock code between them is token-wise and runs on the slice).

Loud where it cannot be exact: head counts not divisible by ``W`` (checked from the config at patch
time and from the tensors at run time, naming the counts), ranks that disagree on the batch (its
:class:`flexgroup.data.agreement.Fingerprint` -- padded layout, the whole row's ids, loss masks, visual inputs --
is all-gathered once per forward, before its first all-to-all: every rank raises, naming the field and the rank), a
KV cache, the MoE aux loss (``output_router_logits``), and sharded inputs given to a model patched
without ``sequence_parallel`` or for another group.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from flexgroup.data.agreement import check_agreement
from flexgroup.data.carrier import tagged_layout
from flexgroup.kernels.ulysses import even_counts, replication, to_heads, to_sequence
from flexgroup.data.sharding import group_rank_world

from .hybrid import active_mask, stateful_modules
from ._interface import SEQUENCE_PARALLEL

__all__ = ["check_group", "configure", "group_of", "check_forward", "install_mixers"]

# config fields holding head counts that sequence parallelism splits (main heads, shared heads, what)
_HEAD_FIELDS = (
    ("num_attention_heads", "num_key_value_heads", "attention"),
    ("linear_num_value_heads", "linear_num_key_heads", "Gated DeltaNet (linear attention)"),
    ("mamba_n_heads", "mamba_n_groups", "Mamba2 SSM"),
    ("mamba_num_heads", "n_groups", "Mamba2 SSM"),
)


def check_group(config, group) -> None:
    """ValueError unless ``group`` is an initialised ProcessGroup whose size splits ``config``'s heads.

    Called before anything is patched; names the counts it refuses.
    """
    _, world = group_rank_world(group, "flexgroup.patch: sequence_parallel=")
    for main, shared, what in _HEAD_FIELDS:
        h = getattr(config, main, None)
        if isinstance(h, int) and h > 0:
            s = getattr(config, shared, None)
            label = f"flexgroup.patch(sequence_parallel=...): {config.model_type} {what} ({main}={h}, {shared}={s})"
            replication(h, s if isinstance(s, int) and s > 0 else h, world, label)


class _State:
    """What ``patch(model, sequence_parallel=group)`` attaches to the language model.

    A deep copy of the model (a reference model, a trainer's copy) shares the process group: a group
    is a handle to the ranks' communicator, it cannot be copied (nor pickled).
    """

    def __init__(self, group, hook_id: int):
        self.group, self.hook_id = group, hook_id

    def __deepcopy__(self, memo) -> "_State":
        return _State(self.group, self.hook_id)


def configure(lm: torch.nn.Module, group) -> None:
    """Switch sequence parallelism over ``group`` on (checked by :func:`check_group`) or off (None).

    Installs (or removes) the model-level hook :func:`check_forward` on the patched language model,
    run first on every forward, and the hybrid mixers' all-to-all wrappers.
    """
    old = lm.__dict__.pop(SEQUENCE_PARALLEL, None)
    if old is not None:
        lm._forward_pre_hooks.pop(old.hook_id, None)
        lm._forward_pre_hooks_with_kwargs.pop(old.hook_id, None)
    if group is not None:
        install_mixers(lm)
        hook = lm.register_forward_pre_hook(check_forward, with_kwargs=True, prepend=True)
        lm.__dict__[SEQUENCE_PARALLEL] = _State(group, hook.id)


def group_of(lm: torch.nn.Module):
    """The process group ``lm`` was patched for (None: no sequence parallelism)."""
    state = lm.__dict__.get(SEQUENCE_PARALLEL)
    return None if state is None else state.group


def check_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on the language model: checks of a sharded forward, once per forward, every rank.

    Same group as patched, no KV cache, this rank's slice of ids and positions, and every rank of the
    group on the same batch (:func:`flexgroup.data.agreement.check_agreement`, one small all-gather; not for
    a streamed chunk, whose whole call was checked).
    """
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    shard = getattr(mask, "shard", None)
    if shard is None:
        return None
    name = type(module).__name__
    if group_of(module) is not shard.group:
        raise ValueError(f"{name} got inputs sharded over another process group than the one it was patched for: "
                         "pass the same group to flexgroup.patch(model, sequence_parallel=group) and "
                         "batch.model_inputs(shard=group)")
    for k in ("cache", "past_key_values", "past_key_value"):
        if kwargs.get(k) is not None:
            raise ValueError(f"{name}: sequence parallelism with a KV cache ({k}=): a sharded row is for scoring and "
                             "training only; pass use_cache=False and no cache")
    if kwargs.get("use_cache"):
        raise ValueError(f"{name}: sequence parallelism with use_cache=True (a KV cache): pass use_cache=False "
                         "(batch.model_inputs(shard=group) does)")
    pos = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    n = shard.local_tokens
    sliced = _keep_slice(kwargs, pos, n)
    ids = kwargs.get("input_ids", args[0] if args else None)
    ids = kwargs.get("inputs_embeds") if ids is None else ids
    if ids is not None and (ids.shape[0] != 1 or ids.shape[1] != n):
        raise ValueError(f"{name}: sharded inputs must be this rank's slice of {n} tokens ({shard.describe()}), got "
                         f"input of shape {tuple(ids.shape)}")
    if pos is None or pos.shape[-1] != n:
        raise ValueError(f"{name}: sharded inputs need this rank's {n} virtual position_ids "
                         "(batch.model_inputs(shard=group) gives them)")
    if tagged_layout(pos) is not shard.layout and not torch.equal(
            pos.reshape(-1, n)[0].cpu(), shard.layout.position_ids[shard.start:shard.stop]):
        raise ValueError(f"{name}: position_ids do not match this rank's virtual positions ({shard.describe()})")
    if shard.agreement is not None:
        check_agreement(shard.agreement, shard.group, shard.rank, shard.world, pos.device, name)
    return (args, kwargs) if sliced else None


def _keep_slice(kwargs: dict, pos, n: int) -> bool:
    """A vision-language batch's window (``MultimodalGroupedBatch.model_inputs(shard=)``): the composite model
    embedded ``[1, n_w, hidden]`` (the slice widened to whole images); keep this rank's ``n`` rows, in place
    in ``kwargs`` (Qwen3-VL: also of ``visual_pos_masks`` [1, n_w] and of each deepstack feature tensor, one
    row per visual token of the window). True if it did."""
    window = getattr(pos, "_flexgroup_window", None)
    emb = kwargs.get("inputs_embeds")
    if window is None or emb is None or emb.shape[1] != window[1] or kwargs.get("input_ids") is not None:
        return False
    o, _, before, inside = window
    kwargs["inputs_embeds"] = emb[:, o:o + n]
    if kwargs.get("visual_pos_masks") is not None:  # Qwen3-VL deepstack: one feature row per visual token
        kwargs["visual_pos_masks"] = kwargs["visual_pos_masks"][:, o:o + n]
        kwargs["deepstack_visual_embeds"] = [e[before:before + inside] for e in kwargs["deepstack_visual_embeds"]]
    return True


# ------------------------------------------------------------------------------ hybrid mixers
def _shard():
    mask = active_mask()
    return None if mask is None else mask.shard


def _group_info(shard):
    return shard.group, dist.get_world_size(shard.group), dist.get_rank(shard.group)


def _sp_conv(inner):
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        """Sharded: ``hidden_states`` [1, C, c] -> channel shards [1, C_r, Lp] -> forked conv -> [1, C, c]."""
        shard = _shard()
        if shard is None:
            return inner(hidden_states, weight, bias, activation=activation, **kwargs)
        group, world, rank = _group_info(shard)
        counts = even_counts(hidden_states.shape[1], world)   # channels are independent: any split is exact
        lo = sum(counts[:rank])
        hi = lo + counts[rank]
        (x,) = to_heads([hidden_states[0][..., None]], [counts], group)        # [C_r, Lp, 1]
        out = inner(x[..., 0][None], weight[lo:hi], None if bias is None else bias[lo:hi], activation=activation,
                    **kwargs)                                                 # [1, C_r, Lp]
        return to_sequence([out[0][..., None]], [counts], group)[0][..., 0][None]

    return causal_conv1d_fn


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """[1, c, H, ...] -> [H, c, R]."""
    return t[0].reshape(t.shape[1], t.shape[2], -1).transpose(0, 1)


def _heads_back(t: torch.Tensor, like_tail: tuple) -> torch.Tensor:
    """[h, Lp, R] -> [1, Lp, h, *like_tail], contiguous as the stock tensors are (callers ``.view`` them)."""
    return t.transpose(0, 1).reshape((1, t.shape[1], t.shape[0]) + like_tail).contiguous()


def _sp_gated_delta(inner):
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, *args, **kwargs):
        """Sharded: q/k [1, c, Hk, K], v [1, c, Hv, V], g/beta [1, c, Hv] -> head shards -> ([1, c, Hv, V], None)."""
        shard = _shard()
        if shard is None:
            return inner(query, key, value, g, beta, *args, **kwargs)
        group, world, _ = _group_info(shard)
        hk, hv = key.shape[2], value.shape[2]
        f = replication(hv, hk, world, f"Gated DeltaNet (value heads {hv}, key heads {hk})")
        if f > 1:
            query, key = query.repeat_interleave(f, 2), key.repeat_interleave(f, 2)
        ck, cv = even_counts(hk * f, world), even_counts(hv, world)
        q, k, v, gg, bb = to_heads([_heads_first(t) for t in (query, key, value, g, beta)], [ck, ck, cv, cv, cv], group)
        out, state = inner(_heads_back(q, query.shape[3:]), _heads_back(k, key.shape[3:]),
                           _heads_back(v, value.shape[3:]), _heads_back(gg, ()), _heads_back(bb, ()), *args, **kwargs)
        (back,) = to_sequence([_heads_first(out)], [cv], group)                # [Hv, c, V]
        return _heads_back(back, out.shape[3:]), state

    return torch_chunk_gated_delta_rule


def _sp_mamba2_scan(inner):
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, *args, **kwargs):
        """Sharded: x [1, c, H, P], dt [1, c, H], B/C [1, c, G, N] -> head shards -> y [1, c, H, P]."""
        shard = _shard()
        if shard is None:
            return inner(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, *args, **kwargs)
        group, world, rank = _group_info(shard)
        h, ng = hidden_states.shape[2], B.shape[2]
        f = replication(h, ng, world, f"Mamba2 (SSM heads {h}, groups {ng})")
        if f > 1:
            B, C = B.repeat_interleave(f, 2), C.repeat_interleave(f, 2)
        ch, cg = even_counts(h, world), even_counts(ng * f, world)
        lo, hi = sum(ch[:rank]), sum(ch[:rank + 1])
        x, d, b, c = to_heads([_heads_first(t) for t in (hidden_states, dt, B, C)], [ch, ch, cg, cg], group)
        per_head = [None if p is None else p[lo:hi] for p in (A, D, dt_bias)]  # [H] parameters: this rank's heads
        y = inner(_heads_back(x, hidden_states.shape[3:]), _heads_back(d, ()), per_head[0],
                  _heads_back(b, B.shape[3:]), _heads_back(c, C.shape[3:]), chunk_size, per_head[1], per_head[2],
                  *args, **kwargs)
        (back,) = to_sequence([_heads_first(y)], [ch], group)
        return _heads_back(back, y.shape[3:])

    return mamba2_chunk_scan


_WRAPPERS = {"causal_conv1d_fn": _sp_conv, "torch_chunk_gated_delta_rule": _sp_gated_delta,
             "mamba2_chunk_scan": _sp_mamba2_scan}
MARK = "_flexgroup_sequence_parallel"


def install_mixers(lm: torch.nn.Module) -> None:
    """Wrap (once) the forking wrappers of every stateful mixer's module with the all-to-all wrappers above.

    TypeError for mixers that hold their kernels as instance attributes (:mod:`flexgroup.patches.hybrid.attrs`,
    transformers 5.10): they are forked, but not all-to-all'ed."""
    held = [type(m).__name__ for _, _, m in stateful_modules(lm) if "_flexgroup_saved_attrs" in m.__dict__]
    if held:
        import transformers  # noqa: PLC0415

        raise TypeError(f"flexgroup.patch(sequence_parallel=...): {lm.config.model_type}: transformers "
                        f"{transformers.__version__}'s {held[0]} holds its kernels as instance attributes, which "
                        "flexgroup forks but does not shard over sequence-parallel ranks. Upgrade transformers "
                        "(pip install -U 'transformers>=5.24') or patch without sequence_parallel")
    for _, _, m in stateful_modules(lm):
        module = sys.modules[type(m).__module__]
        for n, make in _WRAPPERS.items():
            fn = getattr(module, n, None)
            if fn is None or getattr(fn, MARK, False):
                continue
            if getattr(fn, "_flexgroup_original", None) is None:
                continue  # not a function flexgroup.patches.hybrid forks in this module
            wrapped = make(fn)
            setattr(wrapped, MARK, True)
            wrapped._flexgroup_original = fn._flexgroup_original  # flexgroup.patches.hybrid finds its wrapper installed
            setattr(module, n, wrapped)
