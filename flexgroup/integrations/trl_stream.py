"""The TRL GRPO adapter's token budget: chunks of rows too large for one forward are streamed.

:class:`~flexgroup.integrations.trl.FlexGroupGRPOTrainer` packs each chunk of rows into one row. With
``flexgroup_budget=B`` a chunk whose packed row holds more than ``B`` tokens is run through
:mod:`flexgroup.stream` instead (every shared prefix still encoded once, forwards of at most ``B``
tokens each), over the rows' real sequences ``[prompt without left padding; completion without right
padding]`` with the completion tokens as the loss mask, and read back in TRL's ``[rows,
logits_to_keep]`` layout (zero on padding):

- **old policy and reference model** (no gradient): :func:`flexgroup.stream.stream_forward`;
- **policy** (gradient): the log-probs (and entropies) come from the same no-grad pass, returned as
  the outputs of an autograd node (:class:`_StreamedLogprobs`). TRL's loss runs on them unchanged;
  when its backward reaches the node with ``g = dLoss/dlogps`` [rows, logits_to_keep], the node runs
  :func:`flexgroup.stream_backward` with the linear loss ``sum(g * lp)`` under ``torch.enable_grad()``
  (a reentrant backward, like reentrant checkpointing), which leaves in ``.grad`` exactly the
  parameter gradient of TRL's loss. Cost: each streamed policy forward runs twice (once for the
  values, once with gradients in the backward). The RNG state is replayed, so both runs draw alike.

**Data parallel (DDP: accelerate's ``MULTI_CPU`` / ``MULTI_GPU`` / ...).** DDP's reducer expects one
forward under autograd and one backward per step; the streamed backward runs several of each inside
TRL's backward. So with a budget every forward of the policy runs on the unwrapped module (DDP's
reducer never engages) and, once the accumulation window ends (``accelerator.sync_gradients``), each
gradient is averaged over the processes as DDP's own hook does it (divided by the world size, then
summed in one all-reduce): :func:`average_gradients`.

What cannot be exact this way is refused (:func:`check_trainer`, and in the backward): a loss that
differentiates through the entropies (TRL's entropy bonus), reentrant gradient checkpointing, and
sharded training (FSDP, DeepSpeed, Megatron, XLA: every forward of a sharded model all-gathers its
parameters, a collective each process must join equally often, while a streamed pass runs as many
forwards as its own process's rows need).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from accelerate.utils import DistributedType

import flexgroup
from flexgroup.data import padded
from flexgroup.integrations.trl_head import temperature
from flexgroup.stream import check_budget, stream_forward

__all__ = ["StreamedRows", "average_gradients", "check_trainer", "data_parallel"]

Tensor = torch.Tensor


def check_trainer(trainer, budget) -> int:
    """``budget`` checked (an int >= 128, as :func:`flexgroup.stream_backward` takes), or an error naming
    what about ``trainer`` streaming cannot make exact, and the fix."""
    budget = check_budget(budget)
    fix = ("use flexgroup_budget=None (one packed forward per chunk of rows: lower per_device_train_batch_size "
           "or TRL's batch size to bound memory instead)")
    dist = trainer.accelerator.distributed_type
    if dist != DistributedType.NO and not data_parallel(trainer):
        raise NotImplementedError(
            f"flexgroup_budget={budget}: {dist} shards the parameters, so every forward of the model all-gathers "
            "them (and every backward reduce-scatters gradients): collectives that each process must join the same "
            "number of times. Streamed passes run as many forwards as this process's own rows need (another number "
            "on another process: the step would hang), and the policy's inside TRL's backward. Use data parallelism "
            f"(DDP: accelerate's MULTI_GPU / MULTI_CPU) or one process with the budget, or {fix}")
    args = trainer.args
    if getattr(args, "gradient_checkpointing", False) and (getattr(args, "gradient_checkpointing_kwargs", None)
                                                           or {}).get("use_reentrant"):
        raise ValueError(
            f"flexgroup_budget={budget}: reentrant gradient checkpointing (gradient_checkpointing_kwargs="
            f"{args.gradient_checkpointing_kwargs}) gives the kept keys and values of streamed chunks no gradient: "
            "set gradient_checkpointing_kwargs={'use_reentrant': False}, or " + fix)
    if getattr(trainer, "_entropy_bonus_enabled", False):
        raise NotImplementedError(
            f"flexgroup_budget={budget}: the entropy bonus (entropy_coef={getattr(trainer, 'entropy_coef', None)!r}"
            ", or adaptive entropy) differentiates the loss through the entropies, which the streamed policy "
            f"pass does not back-propagate: set entropy_coef=0.0, or {fix}")
    return budget


_DDP = {name for name in ("MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU",
                         "MULTI_HPU", "MULTI_NEURON") if hasattr(DistributedType, name)}


def data_parallel(trainer) -> bool:
    """True when ``trainer``'s accelerator replicates the model over processes (DDP), not sharding it."""
    return trainer.accelerator.distributed_type.name in _DDP


def average_gradients(module: torch.nn.Module) -> int:
    """Average the ``.grad`` of ``module``'s trainable parameters over the default process group, as DDP's
    reducer does (each divided by the world size, then summed): one all-reduce of a flat buffer. A parameter
    without a gradient on some process counts as zero there; one without a gradient anywhere keeps None.
    Every process must call it, with the same parameters. Returns the number of gradients averaged."""
    import torch.distributed as dist

    params = [p for p in module.parameters() if p.requires_grad]
    if not params or not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    dev = params[0].device
    has = torch.tensor([float(p.grad is not None) for p in params], device=dev)
    dist.all_reduce(has)                                       # which parameters have a gradient anywhere
    params = [p for p, h in zip(params, has.tolist()) if h > 0]
    if not params:
        return 0
    world = dist.get_world_size()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for dtype in dict.fromkeys(p.grad.dtype for p in params):       # one bucket per gradient dtype
        bucket = [p for p in params if p.grad.dtype == dtype]
        flat = torch.cat([p.grad.reshape(-1).div(world) for p in bucket])
        dist.all_reduce(flat)
        for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(g.view_as(p.grad))
    return len(params)


class StreamedRows:
    """One chunk of TRL rows as sequences for :mod:`flexgroup.stream`.

    Args:
        trainer: the GRPO trainer (``accelerator``, ``flexgroup_budget``; the temperature is TRL's for ``model``,
            :func:`~flexgroup.integrations.trl_head.temperature`).
        model: the model TRL passed (policy, old policy or reference).
        pid, pm, cid, cm: [n, Lp] left-padded prompts and [n, k] right-padded completions (ids, masks),
            every row with a non-empty prompt and completion.
        tokens: tokens of the rows' packed trie (counted as ``recomputed_tokens`` by the policy's backward).
        vision: per row its visual inputs (a Qwen-VL model; :mod:`flexgroup.integrations.trl_vision`) or None.
    """

    def __init__(self, trainer, model, pid: Tensor, pm: Tensor, cid: Tensor, cm: Tensor, tokens: int = 0,
                 vision: list | None = None):
        self.trainer, self.model, self.tokens, self.vision = trainer, model, tokens, vision
        self.temperature = temperature(trainer, model)   # what TRL divides this model's logits by
        self.device, self.n, self.k = cid.device, cid.shape[0], cid.shape[1]
        pid, pm, cid, cm = padded.check_padded(pid, pm, cid, cm)
        self.seqs, self.masks, plen = padded.trie_rows(pid, pm, cid, cm)
        clen = cm.sum(1)
        self.rows = torch.repeat_interleave(torch.arange(self.n), clen)                       # [M]
        self.cols = torch.cat([torch.arange(int(c)) for c in clen])                            # [M] in [0, k)
        self.seq_cols = self.cols + torch.tensor(plen)[self.rows]                              # [M] in [0, T)
        self.width = max(s.numel() for s in self.seqs)

    def to_rows(self, x: Tensor) -> Tensor:
        """[n, T] in the sequences' layout -> [n, k] in TRL's (zero on padding), on the rows' device."""
        out = x.new_zeros(self.n, self.k)
        out[self.rows, self.cols] = x[self.rows, self.seq_cols]
        return out.to(self.device)

    def _autocast(self):
        acc = getattr(self.trainer, "accelerator", None)
        return acc.autocast() if acc is not None else nullcontext()

    def values(self, entropy: bool) -> tuple[Tensor, Tensor | None, int]:
        """No-grad streamed pass: ``([n, k] log-probs, [n, k] entropies or None, forwards run)``."""
        with self._autocast():
            res = stream_forward(self.model, self.seqs, loss_masks=self.masks, budget=self.trainer.flexgroup_budget,
                                 temperature=self.temperature, return_entropy=entropy, vision=self.vision)
        ent = self.to_rows(res.entropy) if entropy else None
        return self.to_rows(res.logprobs), ent, res.forwards

    def backward(self, g: Tensor) -> int:
        """Accumulate into ``.grad`` the parameter gradient of ``sum(g * logps)``; ``g`` [n, k]. Returns the
        forwards run."""
        dev = next(self.model.parameters()).device
        gs = torch.zeros(self.n, self.width, dtype=g.dtype, device=dev)
        gs[self.rows.to(dev), self.seq_cols.to(dev)] = g.to(dev)[self.rows.to(dev), self.cols.to(dev)]

        def linear_loss(lp: Tensor, index: Tensor) -> Tensor:
            return (gs[index].to(lp.dtype) * lp).sum()

        with torch.enable_grad(), self._autocast():
            res = flexgroup.stream_backward(self.model, self.seqs, linear_loss, loss_masks=self.masks,
                                            budget=self.trainer.flexgroup_budget, temperature=self.temperature,
                                            vision=self.vision)
        return res.forwards

    def run(self, entropy: bool, stats: dict) -> tuple[Tensor, Tensor | None]:
        """The streamed pass TRL's call needs: :meth:`policy` under autograd, else :meth:`values` (counted)."""
        if torch.is_grad_enabled():
            return self.policy(entropy, stats)
        lp, ent, forwards = self.values(entropy)
        stats["forwards"] += forwards
        stats["streamed_forwards"] += forwards
        return lp, ent

    def policy(self, entropy: bool, stats: dict) -> tuple[Tensor, Tensor | None]:
        """Policy pass: ``([n, k] log-probs, [n, k] entropies or None)`` attached to the graph through
        :class:`_StreamedLogprobs` (the backward streams the gradient)."""
        anchor = torch.zeros((), device=self.device, requires_grad=True)   # an input that requires grad: the
                                                                            # node's outputs then do too
        out = _StreamedLogprobs.apply(anchor, self, entropy, stats)
        return out[0], (out[1] if entropy else None)


def _rng_state(device: torch.device) -> tuple:
    cuda = device.type == "cuda"
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if cuda else None), ([device] if cuda else [])


class _StreamedLogprobs(torch.autograd.Function):
    """Outputs: the streamed log-probs [n, k] (and entropies); backward: stream_backward with ``sum(g * lp)``."""

    @staticmethod
    def forward(ctx, anchor, rows: StreamedRows, entropy: bool, stats: dict):
        dev = next(rows.model.parameters()).device
        ctx.rows, ctx.stats, ctx.rng = rows, stats, _rng_state(dev)
        ctx.set_materialize_grads(False)
        lp, ent, forwards = rows.values(entropy)
        stats["forwards"] += forwards
        stats["streamed_forwards"] += forwards
        return (lp, ent) if entropy else (lp,)

    @staticmethod
    def backward(ctx, g_lp, g_ent=None):
        if g_ent is not None and bool((g_ent != 0).any()):
            raise RuntimeError(
                "flexgroup: the loss differentiates through the entropies of a streamed policy pass "
                "(flexgroup_budget), which streaming does not back-propagate (the gradient would be wrong): "
                "drop the entropy term from the loss (entropy_coef=0.0) or use flexgroup_budget=None")
        if g_lp is not None:
            cpu, cuda, devices = ctx.rng
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(cpu)
                if cuda is not None:
                    torch.cuda.set_rng_state(cuda, devices[0])
                forwards = ctx.rows.backward(g_lp)
            for key in ("forwards", "streamed_forwards", "recomputed_forwards"):
                ctx.stats[key] += forwards
            ctx.stats["recomputed_tokens"] += ctx.rows.tokens
        return None, None, None, None
