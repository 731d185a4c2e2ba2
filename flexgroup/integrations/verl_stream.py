"""Prefix tries bigger than verl's per-GPU token budget, streamed with their shared prefix encoded once.

:func:`flexgroup.integrations.verl_batch.whole_batch_step` plans a mini-batch's samples into forwards of at
most ``budget`` grouped tokens. A prefix trie (a prompt and its group's responses, turns in common) bigger
than the budget would be *cut*: its shared prefix re-encoded in every forward its samples land in. Where
that re-encodes more than :data:`STREAM_SHARE` of the trie's grouped tokens, :func:`streamed_tries` picks
the trie to be *streamed* instead, by flexgroup's own machinery (:func:`flexgroup.stream_backward` /
:func:`flexgroup.stream.stream_forward`; under Ulysses the model is patched with ``sequence_parallel=group`` and
the stream shards every forward over it, :mod:`flexgroup.stream.shard`): chunks of at most ``budget``
tokens, each attending to the keys and values its ancestors' chunks kept, so the prefix is encoded and
back-propagated once.

:func:`run_stream` streams one trie and returns verl's outputs for its samples: sample ``i`` (``n_i``
tokens) is streamed as ``input_ids[i] + [last label]`` (the token verl's rolled labels put after it), so
the stream's log-probs ``lp[k, 1 : n_i + 1]`` are verl's jagged entries ``0 .. n_i - 1``, the last one
included. verl's loss function runs on each forward's finished samples (a sum over samples with global
normalizers: :func:`~flexgroup.integrations.verl_batch.plan_refusal` checked it).

Streaming is refused -- the trie is cut, exactly, with one warning naming the cause -- by
:func:`stream_refusal`: more than one data-parallel replica (a stream runs a number of forwards that
depends on its data, and FSDP needs the same number of collective forwards on every rank), a budget
below :data:`flexgroup.stream.MIN_BUDGET`, FSDP1, an fp16 gradient scaler, ``calculate_sum_pi_squared``,
entropy in the training pass, and (per trie) samples of one trie at different temperatures.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from flexgroup.stream import MIN_BUDGET, stream_backward, stream_forward
from flexgroup.integrations.verl_plan import LAST_LABEL, grouped_tokens, plan_forwards
from flexgroup.layout.trie import SortedNodes
from flexgroup.integrations.verl_vision import is_vision_batch

__all__ = ["STREAM_SHARE", "streamed_tries", "stream_refusal", "temperature_of", "choose_streams", "run_stream"]

Tensor = torch.Tensor
STREAM_SHARE = 0.05  # stream a trie when cutting it would re-encode more than this share of its grouped tokens


def streamed_tries(seqs: list[list[int]], budget: int, share: float = STREAM_SHARE) -> list[tuple[list[int], int, int]]:
    """The tries worth streaming: ``(samples, prefix tokens, forwards cutting would spread it over)`` each.

    Walks the prefix trie top-down (sorted order, as :func:`~flexgroup.integrations.verl_plan.plan_forwards`):
    a node of at most ``budget`` grouped tokens, one sequence, or identical copies is left to the planner;
    a bigger node whose own shared prefix (``depth`` tokens) cutting would re-encode in ``k - 1`` more
    forwards, ``depth * (k - 1) > share * cost``, is streamed whole; otherwise its children are visited.
    """
    n = len(seqs)
    if n < 2:
        return []
    trie = SortedNodes(seqs)
    out = []
    stack = [(0, n)]
    while stack:
        a, b = stack.pop()
        cost = trie.cost(a, b)
        if cost <= budget or trie.is_leaf(a, b):
            continue
        depth = trie.depth(a, b)
        samples = [trie.order[k] for k in range(a, b)]
        spread = len(plan_forwards([seqs[i] for i in samples], budget).forwards)
        if depth * (spread - 1) > share * cost:
            out.append((sorted(samples), depth, spread))
            continue
        stack.extend(reversed(trie.children(a, b)))
    return sorted(out)


def stream_refusal(engine, data, budget: int, forward_only: bool) -> tuple[str, str] | None:
    """None when the engine may stream a trie of this mini-batch; else ``(kind, reason)`` (one warning per kind
    and engine, then the trie is cut)."""
    from verl.utils import tensordict_utils as tu

    get = lambda key: tu.get_non_tensor_data(data=data, key=key, default=False)  # noqa: E731
    if budget < MIN_BUDGET:
        return "budget", (f"the budget ({budget} tokens) is below one streamed block ({MIN_BUDGET} tokens, "
                          "flexgroup.stream.MIN_BUDGET)")
    if is_vision_batch(data):
        return "vision", "multimodal inputs: streamed forwards take text tries only here"
    dp = engine.get_data_parallel_size()
    if dp > 1:
        return "replicas", (f"{dp} data-parallel replicas: a stream's number of forwards depends on its data, "
                            "and FSDP needs as many collective forwards on every rank (streaming runs on one "
                            "replica: 1 rank, or one Ulysses group)")
    if engine.engine_config.strategy == "fsdp":
        return "fsdp1", "strategy='fsdp' (FSDP1): streaming runs backwards of chunks whose graphs overlap; use fsdp2"
    if getattr(engine, "scaler", None) is not None:
        return "scaler", "an fp16 gradient scaler: streaming runs its own backwards, unscaled"
    if get("calculate_sum_pi_squared"):
        return "sum_pi_squared", "calculate_sum_pi_squared=True: streaming returns log-probs and entropies only"
    if not forward_only and get("calculate_entropy"):
        return "entropy", ("entropy in the training pass (entropy_coeff != 0 or calculate_entropy): streaming's "
                           "backward takes log-probs only")
    return None


def temperature_of(data, samples: list[int]) -> float | None:
    """The one temperature of ``samples``, or None when they differ (the trie is then cut). Rounded to float32,
    as verl's step (and the engine's grouped forwards) divide the logits by a float32 temperature."""
    t = data["temperature"]
    t = (t if isinstance(t, Tensor) else torch.tensor([float(t)] * len(samples))).reshape(-1).float()
    vals = torch.unique(t[torch.tensor(samples)] if t.numel() > max(samples) else t)
    return float(vals[0]) if vals.numel() == 1 else None


def choose_streams(engine, data, seqs: list[list[int]], budget: int,
                   forward_only: bool) -> list[tuple[list[int], float]]:
    """The tries of this mini-batch to stream, ``(samples, temperature)`` each (:func:`streamed_tries`), after
    :func:`stream_refusal` and the per-trie temperature check; a refused trie is cut by the planner (exact)
    with one warning per engine naming the cause."""
    out = []
    for samples, prefix, spread in streamed_tries(seqs, budget):
        refusal = stream_refusal(engine, data, budget, forward_only)
        temperature = temperature_of(data, samples) if refusal is None else None
        if refusal is None and temperature is None:
            refusal = "temperature", "its samples have different temperatures (a stream runs one temperature)"
        if refusal is None:
            out.append((samples, temperature))
            continue
        kind, reason = refusal
        cost = grouped_tokens([seqs[i] for i in samples])
        engine._flexgroup_warn_once(
            f"a trie over the budget, not streamed: {kind}",
            f"flexgroup: a prefix trie of {cost} grouped tokens exceeds the per-GPU token budget ({budget}) and is "
            f"not streamed -- {reason} -- so it is cut: its shared prefix ({prefix} tokens) is re-encoded in each "
            f"of {spread} forwards (exact, less sharing). Remove the cause, or raise ppo_max_token_len_per_gpu "
            "(dynamic bsz) or the micro-batch size to keep it whole.")
    return out


def _jagged(lp: Tensor, lens: list[int]) -> Tensor:
    """verl's jagged rows from stream rows: ``lp`` [n, T] -> nested [n, lens[k]] of ``lp[k, 1 : lens[k] + 1]``."""
    device = lp.device
    rows = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    cols = torch.cat([torch.arange(1, m + 1, device=device) for m in lens])
    offsets = torch.tensor([0] + lens, device=device).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(lp[rows, cols], offsets)


def run_stream(engine, source, samples: list[int], budget: int, temperature: float, loss_function,
               forward_only: bool, sync_last: bool) -> tuple[dict[int, dict[str, Tensor]], float, int, int]:
    """Stream ``samples`` of the mini-batch ``source`` (jagged, carrying the last labels) through the engine.

    Args:
        engine: the ``FlexGroupFSDPEngine`` (patched; one data-parallel replica: :func:`stream_refusal`).
        source: the mini-batch TensorDict, with ``flexgroup_last_label`` [N].
        samples: the trie's sample indices into ``source``.
        budget: tokens per forward (>= MIN_BUDGET).
        temperature: the samples' one temperature.
        loss_function: verl's loss (None: forward only).
        forward_only: no gradients.
        sync_last: whether FSDP reduces gradients in this stream's backwards (the mini-batch's last step).

    Returns:
        ``(outputs, loss_total, forwards, tokens)``: per sample, its ``log_probs`` (and ``entropy`` where the
        forward-only pass asks) [n_i]; the sum of verl's loss over the stream's calls; model forwards run;
        grouped tokens run (each trie token once).
    """
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id, get_device_name

    ids = source["input_ids"]
    device = ids.values().device
    rows = ids.values().cpu().split(ids.offsets().diff().tolist())
    last = source[LAST_LABEL].cpu()
    seqs = [torch.cat([rows[i], last[i:i + 1]]) for i in samples]              # [n_i + 1] each
    lens = [rows[i].numel() for i in samples]
    want_entropy = bool(tu.get_non_tensor_data(data=source, key="calculate_entropy", default=False))
    world = engine.ulysses_sequence_parallel_size if engine.use_ulysses_sp else 1
    total = [0.0]

    def loss_fn(lp: Tensor, index: Tensor) -> Tensor:
        idx = index.tolist()
        sub = tu.index_select_tensor_dict(source, [samples[k] for k in idx]).to(get_device_id())
        mo = {"log_probs": _jagged(lp, [lens[k] for k in idx])}
        loss, _ = loss_function(model_output=mo, data=sub, dp_group=engine.get_data_parallel_group())
        total[0] += float(loss.detach())
        return loss * world  # verl's Ulysses rule: FSDP averages the gradients over the SP ranks too

    autocast_dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
    autocast = (nullcontext() if autocast_dtype == torch.float32
                else torch.autocast(device_type=get_device_name(), dtype=autocast_dtype))
    sync = nullcontext() if forward_only else engine._gradient_sync_context(is_last_micro_batch=sync_last)
    engine._flexgroup_patch()
    with autocast, sync, torch.profiler.record_function("flexgroup_stream"):
        if forward_only:
            res = stream_forward(engine.module, seqs, budget=budget, temperature=temperature,
                                 return_entropy=want_entropy)
        else:
            res = stream_backward(engine.module, seqs, loss_fn, budget=budget, temperature=temperature)
    outs: dict[int, dict[str, Tensor]] = {i: {} for i in samples}
    entropy = res.entropy if forward_only and want_entropy else None
    for key, rows_ in (("log_probs", res.logprobs), ("entropy", entropy)):
        if rows_ is not None:
            for i, t in zip(samples, _jagged(rows_, lens).unbind()):
                outs[i][key] = t.to(device)
    if forward_only and loss_function is not None:  # a forward-only pass that still reports verl's loss
        mo = {key: torch.nested.as_nested_tensor([outs[i][key] for i in samples], layout=torch.jagged)
              for key in outs[samples[0]]}
        with torch.no_grad():
            loss, _ = loss_function(model_output=mo, data=tu.index_select_tensor_dict(source, samples).to(
                get_device_id()), dp_group=engine.get_data_parallel_group())
        total[0] += float(loss)
    return outs, total[0], res.forwards, grouped_tokens([s.tolist() for s in seqs])
