"""The verl engine's whole-mini-batch step: forwards planned by prefix trie across verl's micro-batches.

:class:`flexgroup.integrations.verl.FlexGroupFSDPEngine` calls :func:`whole_batch_step` from its
``forward_backward_batch``. verl would run one forward per micro-batch (``prepare_micro_batches``:
fixed sizes, or dynamic batch sizing that mixes groups); here the mini-batch's samples are instead
re-partitioned into forwards by :func:`flexgroup.integrations.verl_plan.plan_forwards` under the same
per-GPU token budget (counting GROUPED tokens), and each forward runs the engine's grouped
``forward_step`` on its samples.

What verl receives is what its stock step returns: verl's own micro-batches are still formed, and
each one's ``model_output`` (log-probs, entropies, ... in its sample order and layout), loss value and
metrics are computed from the planned forwards' outputs by verl's loss function on that micro-batch.
The gradient is the sum over forwards of the loss of each forward's samples, which equals the sum
over verl's micro-batches only when the loss is a sum over samples with global normalizers:
:func:`plan_refusal` says when it is not (the engine then keeps verl's micro-batches). A guard
compares the two totals after every training step and raises if they differ.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from flexgroup.integrations.verl_plan import LAST_LABEL, plan_forwards
from flexgroup.integrations.verl_stream import choose_streams, run_stream
from flexgroup.integrations.verl_vision import is_vision_batch, plan_sequences, vision_patches

__all__ = ["whole_batch_step", "plan_refusal", "token_budget", "EXACT_POLICY_LOSSES"]

# verl 0.9 policy losses that are per-token / per-sample terms aggregated by agg_loss with the global batch
# info: summing them over any partition of the mini-batch gives the same total. Not here: clip_cov and
# kl_cov (pick tokens by covariance over the micro-batch), geo_mean (torch.mean over the micro-batch),
# bypass_mode and anything registered later (unknown).
EXACT_POLICY_LOSSES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "dro", "cispo")


def plan_refusal(loss_function, data) -> str | None:
    """None when the engine may plan forwards across verl's micro-batches exactly; else the reason.

    Exact: no loss (the forward-only passes), or verl's ``ppo_loss`` with a policy loss in
    :data:`EXACT_POLICY_LOSSES` and a ``loss_agg_mode`` normalised by global batch info -- ``token-mean``
    (``batch_num_tokens``, which ``forward_backward_batch`` always sets), ``token-sum``,
    ``seq-mean-token-sum`` / ``seq-mean-token-mean`` with ``global_batch_size`` set,
    ``seq-mean-token-sum-norm`` with ``global_batch_size`` set and a fixed horizon (``loss_scale_factor``, or
    verl's padded ``response_mask``, whose width is the rollout's in every micro-batch; a jagged one would
    give each micro-batch its own width).
    """
    if loss_function is None:
        return None
    from verl.workers.utils.losses import ppo_loss

    func = getattr(loss_function, "func", loss_function)
    if func is not ppo_loss:
        name = getattr(func, "__qualname__", repr(func))
        return f"loss function {name}: not known to be a sum over samples with global normalizers"
    config = loss_function.keywords.get("config", loss_function.args[0] if loss_function.args else None)
    mode = config.policy_loss.get("loss_mode", "vanilla")
    if mode not in EXACT_POLICY_LOSSES:
        return f"policy_loss.loss_mode={mode!r}: it normalizes or selects tokens per micro-batch"
    gbs = tu.get_non_tensor_data(data=data, key="global_batch_size", default=None)
    fixed_width = "response_mask" in data.keys() and not data["response_mask"].is_nested
    for agg in {config.loss_agg_mode} | ({"seq-mean-token-mean"} if mode == "sapo" else set()):
        if agg in ("token-mean", "token-sum"):
            continue  # batch_num_tokens: forward_backward_batch always sets it
        if agg in ("seq-mean-token-sum", "seq-mean-token-mean") and gbs is not None:
            continue
        if agg == "seq-mean-token-sum-norm" and gbs is not None and (config.loss_scale_factor is not None
                                                                     or fixed_width):
            continue  # horizon: loss_scale_factor, else response_mask's width (the rollout's, in every micro-batch)
        if agg.startswith("seq-mean"):
            why = "without global_batch_size" + ("" if agg != "seq-mean-token-sum-norm" else
                                                 " (or with a jagged response_mask and no loss_scale_factor)")
        else:
            why = "(unknown mode)"
        return f"loss_agg_mode={agg!r} {why}: it normalizes per micro-batch"
    return None


def token_budget(data, micro_batches) -> int:
    """The per-forward token budget verl set: ``max_token_len_per_gpu`` x ``sp_size`` with dynamic batch
    sizing, else the largest of verl's micro-batches in the tokens the stock step feeds the model (real
    tokens with remove-padding, samples x longest sample without)."""
    if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        return int(data["max_token_len_per_gpu"]) * int(tu.get_non_tensor_data(data=data, key="sp_size", default=1))
    rmpad = tu.get_non_tensor_data(data=data, key="use_remove_padding", default=True)
    best = 0
    for mb in micro_batches:
        lens = mb["input_ids"].offsets().diff()
        best = max(best, int(lens.sum()) if rmpad else lens.numel() * int(lens.max()))
    return best


def _same_count(n: int, group) -> int:
    """The largest ``n`` over the data-parallel ranks (FSDP needs the same number of forwards on each)."""
    t = torch.tensor([n], device=get_device_id())
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(t.item())


def whole_batch_step(engine, data, loss_function, forward_only: bool) -> dict:
    """verl's ``forward_backward_batch`` contract (``{"model_output", "loss", "metrics"}``) with planned
    forwards. ``data``: the mini-batch (jagged, no padding) already carrying ``batch_num_tokens``,
    ``dp_size`` and ``sp_size``; the caller checked :func:`plan_refusal` and the engine's fallback reasons.
    """
    return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
    group = engine.get_data_parallel_group()
    micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
    if indices is None:  # fixed sizes: verl chunks in order
        sizes = [len(mb) for mb in micro_batches]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        indices = [list(range(s, s + n)) for s, n in zip(starts, sizes)]
    ids = data["input_ids"]
    seqs = (plan_sequences(data, engine._flexgroup_model()) if is_vision_batch(data)   # placeholders keyed by pixels
            else [row.tolist() for row in ids.values().cpu().split(ids.offsets().diff().tolist())])
    budget = token_budget(data, micro_batches)
    streams = choose_streams(engine, data, seqs, budget, forward_only)         # [(samples, temperature)]
    streamed = {i for samples, _ in streams for i in samples}
    rest = [i for i in range(len(seqs)) if i not in streamed]
    plan = _plan_subset(seqs, rest, budget)
    count = _same_count(len(plan.forwards), group)
    if count > len(plan.forwards):
        plan = _plan_subset(seqs, rest, budget, min_forwards=count)
    _count_stock_tokens(engine.flexgroup_stats, micro_batches)

    # verl rolls each micro-batch's packed labels: a sample's last entry scores the first token of the next sample
    # of ITS micro-batch (nothing reads it, but it is returned); planned forwards reproduce that value
    firsts = ids.values()[ids.offsets()[:-1]]
    last = torch.empty_like(firsts)
    for idx in indices:
        last[torch.tensor(idx)] = firsts[torch.tensor(idx[1:] + idx[:1])]
    source = data.copy()
    source[LAST_LABEL] = last
    per_sample: dict[str, list] = {}
    forward_total = 0.0
    stats = engine.flexgroup_stats
    for k, (samples, temperature) in enumerate(streams):  # tries over the budget (verl_stream): streamed first
        outs, total, forwards, tokens = run_stream(engine, source, samples, budget, temperature, loss_function,
                                                   forward_only, sync_last=count == 0 and k == len(streams) - 1)
        forward_total += total
        stats.streamed_tries += 1
        stats.streamed_forwards += forwards
        stats.forwards += forwards
        stats.grouped_tokens += tokens
        for i, out in outs.items():
            for key, t in out.items():
                per_sample.setdefault(key, [None] * len(seqs))[i] = t
    scaler = getattr(engine, "scaler", None)
    # a rank with fewer samples than another rank's forwards runs padding forwards (one sample, zero loss, outputs
    # dropped): FSDP gathers parameters collectively, so every rank must run as many forwards and backwards
    padding = count - len(plan.forwards)
    steps = plan.forwards + ([plan.forwards[0][:1]] * padding if padding > 0 else [])
    for j, samples in enumerate(steps):
        padding = j >= len(plan.forwards)
        sub = tu.index_select_tensor_dict(source, samples)
        sync = nullcontext() if forward_only else engine._gradient_sync_context(is_last_micro_batch=j == count - 1)
        ctx = torch.no_grad() if forward_only else nullcontext()
        with ctx, sync, torch.profiler.record_function(f"flexgroup_forward{j}"):
            fn = _zero_loss if padding and not forward_only else (None if padding else loss_function)
            loss, meta = engine.forward_step(sub, loss_function=fn, forward_only=forward_only)
            if not forward_only:
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if padding:
            continue
        forward_total += meta["loss"] if loss_function is not None else 0.0
        for key, nt in meta["model_output"].items():
            slot = per_sample.setdefault(key, [None] * len(seqs))
            for i, t in zip(samples, nt.unbind()):
                slot[i] = t

    output_lst = []
    micro_total = 0.0
    for mb, idx in zip(micro_batches, indices):
        mo = {key: torch.nested.as_nested_tensor([vals[i] for i in idx], layout=torch.jagged)
              for key, vals in per_sample.items()}
        if loss_function is not None:
            with torch.no_grad():
                loss, metrics = loss_function(model_output=mo, data=mb.to(get_device_id()), dp_group=group)
            micro_total += loss.item()
        else:
            loss, metrics = torch.tensor(1.0), {}
        out = {"loss": loss.item(), "metrics": metrics}
        if forward_only or return_model_output:
            out["model_output"] = mo
        output_lst.append(out)
    if loss_function is not None and not _close(forward_total, micro_total):
        raise RuntimeError(
            f"flexgroup: the loss summed over planned forwards ({forward_total!r}) differs from the loss summed "
            f"over verl's micro-batches ({micro_total!r}): this loss is not a sum over samples with global "
            "normalizers, so the gradient just accumulated is not verl's. Report the loss configuration; "
            "set FlexGroupFSDPEngine.flexgroup_plan_whole_batch = False to keep verl's micro-batches.")
    return postprocess_batch_func(output_lst=output_lst, indices=_restore_indices(data, indices), data=data)


def _plan_subset(seqs, subset: list[int], budget: int, min_forwards: int = 1):
    """:func:`plan_forwards` of the samples ``subset`` (indices into ``seqs``), in ``seqs``' indices."""
    plan = plan_forwards([seqs[i] for i in subset], budget, min_forwards=min_forwards)
    plan.forwards = [[subset[k] for k in f] for f in plan.forwards]
    return plan


def _zero_loss(model_output, data, dp_group=None):
    """A padding forward's loss (zero, with the graph attached so FSDP's backward collectives still run)."""
    return sum(v.values().sum() for v in model_output.values()) * 0.0, {}


def _restore_indices(data, indices):
    """What verl's ``postprocess_batch_func`` expects: dynamic-bsz index lists, else None (in order)."""
    return indices if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True) else None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * max(1.0, abs(a), abs(b))


def _count_stock_tokens(stats, micro_batches) -> None:
    """``sequences`` / ``real_tokens`` / ``padded_tokens`` as verl's stock step would feed them (its micro-batches)."""
    for mb in micro_batches:
        lens = mb["input_ids"].offsets().diff()
        stats.sequences += lens.numel()
        stats.real_tokens += int(lens.sum())
        stats.padded_tokens += lens.numel() * int(lens.max())
        stats.vision_patches += vision_patches(mb)
