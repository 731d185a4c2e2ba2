"""Ulysses sequence parallelism in flexgroup's verl engine: grouped micro-batches over verl's SP group.

With ``ulysses_sequence_parallel_size = W > 1`` verl's stock step slices its packed row over the ``W``
ranks of its ``sp`` mesh dimension and relies on a Ulysses patch of *flash attention* for the
all-to-alls. :class:`flexgroup.integrations.verl.FlexGroupFSDPEngine` instead patches the model with
flexgroup's own sequence parallelism over the same group (``flexgroup.patch(model,
sequence_parallel=engine.ulysses_parallel_group)``) and runs each grouped micro-batch as:

1. every rank of the SP group builds the same :class:`~flexgroup.GroupedBatch` (verl gives the ranks
   of one SP group the same data) and runs its slice of the padded packed row,
   ``batch.model_inputs(shard=group)``: logits ``[c, V]``, ``c = Lp / W``;
2. a token's outputs (log-prob, entropy, ...) are computed on the rank that holds the logit row
   predicting it -- the same rule as ``batch.logprobs(shard=)`` -- with the engine's own per-token code
   (``_flexgroup_outputs``: per-sample temperatures, entropy settings), every other token 0;
3. the ``[T]`` values are summed over the group (:class:`SumOverGroup`), so every rank returns verl's
   full ``log_probs`` / ``entropy`` for the micro-batch, in verl's layout, and runs verl's loss on them,
   as verl's stock Ulysses step does after its all-gather. Backward: each rank keeps the gradient of
   its own tokens, multiplied by ``W`` -- verl's ``Gather(grad_scaler=True)`` rule, which compensates
   FSDP averaging the gradients over the ``sp`` ranks as well as the ``dp`` ranks.

No verl import here: the engine passes itself in.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

__all__ = ["SumOverGroup", "sharded_outputs"]

Tensor = torch.Tensor


class SumOverGroup(torch.autograd.Function):
    """``all_reduce(SUM)`` of ``x`` over ``group``; backward: the incoming gradient times the group size.

    Every rank computes the same loss from the summed tensor, so the incoming gradient is the same on
    every rank; each rank passes it back to its own (nonzero) entries only, scaled by ``W`` so that
    FSDP's average over the SP ranks gives the gradient of one copy of the loss (verl's rule).
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.world = dist.get_world_size(group)
        out = x.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.world, None


def sharded_outputs(engine, batch, mb, group) -> dict[str, Tensor]:
    """verl's ``model_output`` of one grouped micro-batch run sequence-parallel over ``group``.

    Args:
        engine: the ``FlexGroupFSDPEngine`` (its ``module`` patched with ``sequence_parallel=group``).
        batch: the micro-batch's :class:`~flexgroup.GroupedBatch`; identical on every rank of ``group``.
        mb: verl's micro-batch (jagged ``input_ids`` [N, n_i], ``temperature``, ...).
        group: verl's Ulysses process group (``engine.ulysses_parallel_group``).

    Returns:
        ``log_probs`` (and ``entropy`` / ``sum_pi_squared`` where asked): jagged [N, n_i] with the
        micro-batch's offsets, whole on every rank, equal to the unsharded step's.
    """
    ids = mb["input_ids"]
    device = ids.values().device
    inputs = batch.model_inputs(device, shard=group)
    shard = inputs["attention_mask"].shard
    logits = engine.module(**inputs).logits[0]                                 # [c, V] this rank's rows
    rows = torch.cat(batch.paths).to(device)                                   # [T] packed row of each token
    own = (rows >= shard.start) & (rows < shard.stop)                          # [T] tokens predicted here
    # rows held elsewhere read one extra zero row (index c); their values are dropped below
    local = torch.where(own, rows - shard.start, torch.full_like(rows, shard.local_tokens))
    lens = ids.offsets().diff().tolist()
    view = SimpleNamespace(paths=list(local.split(lens)))
    padded = torch.cat([logits, logits.new_zeros(1, logits.shape[-1])])        # [c + 1, V]
    out = engine._flexgroup_outputs(padded, view, mb)
    for key, value in out.items():
        flat = torch.where(own, value.values(), torch.zeros((), dtype=value.dtype, device=device))
        out[key] = torch.nested.nested_tensor_from_jagged(SumOverGroup.apply(flat, group), ids.offsets())
    return out
