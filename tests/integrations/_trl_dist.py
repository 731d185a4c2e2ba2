"""Two-process TRL runs on CPU for ``test_trl_distributed.py`` (gloo on 127.0.0.1, accelerate's MULTI_CPU = DDP).

``python tests/integrations/_trl_dist.py OUTDIR CASE [CASE ...]`` spawns 2 ranks (``tests/_gloo.spawn_ranks``: the
rendezvous store held by the parent, 120 s collective timeout, a failed or hung rank stops all with its
stack), each with the environment ``accelerate launch`` gives its processes (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the gloo group already initialised (accelerate reuses
it); ``use_cpu=True`` makes accelerate's state MULTI_CPU with gloo,
and the Trainer wraps the policy in ``DistributedDataParallel``. Each rank trains every CASE (2 steps, same
seed, completions replayed as in ``test_trl.py``, offset by rank so no two rows repeat) and saves
``OUTDIR/CASE.rank{r}.pt``: per step the loss, the logged metrics, every parameter gradient after the
backward (DDP's all-reduce included), then the weights after the last step and the adapter's counters.

Cases ``fsdp_*`` shard the policy (and the reference model) with FSDP2 instead, through the Trainer's
``fsdp_config``; accelerate enables FSDP only on accelerator devices, so :func:`_fsdp_on_cpu` sets its
state to FSDP on CPU as it does there (the rest -- ``fully_shard`` per decoder layer, gloo collectives --
is accelerate's and torch's own code). Gradients are saved as full tensors.

Inputs in OUTDIR: ``model`` (tiny Llama, 512 positions) and ``ref`` (another seed, DPO's reference).
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import torch

WORLD = 2
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from _gloo import spawn_ranks  # noqa: E402


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


class Steps:
    """Trainer mixin (first in the bases): per training step the loss, the metrics and every gradient."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        metrics = {k: v[-1] for k, v in self._metrics["train"].items() if v}
        self.__dict__.setdefault("steps", []).append({"loss": loss.detach().clone(), "metrics": metrics})
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        out = super().training_step(model, inputs, num_items_in_batch)
        self.steps[-1]["grads"] = {n: _full(p.grad) for n, p in self.model.named_parameters() if p.grad is not None}
        return out


def _words(g, n):
    from _trainers import LETTERS

    return " ".join(LETTERS[int(t)] for t in torch.randint(0, 26, (n,), generator=g))


def _fix_generations(trainer, rank: int) -> None:
    """Deterministic completions (a function of the prompt, its occurrence on this rank, and the rank)."""
    width = trainer.args.max_completion_length
    eos, pad = trainer.processing_class.eos_token_id, trainer.processing_class.pad_token_id

    def generate(input_ids, attention_mask=None, **kwargs):
        seen = collections.Counter()
        rows = []
        for ids, m in zip(input_ids, attention_mask if attention_mask is not None else torch.ones_like(input_ids)):
            key = tuple(ids[m.bool()].tolist())
            j = seen[key] + 10 * rank
            seen[key] += 1
            gen = torch.Generator().manual_seed(sum(key) * 7919 + j)
            n = 2 + (sum(key) + 5 * j) % (width - 1)
            c = torch.randint(3, 29, (n,), generator=gen)
            if n < width:
                c[-1] = eos
            rows.append(torch.cat([c, torch.full((width - n,), pad)]))
        return torch.cat([input_ids, torch.stack(rows).to(input_ids)], 1)

    trainer.model.generate = generate


def _reward(completions, **kwargs):
    return [float(c.count("a") + c.count("e")) - 0.05 * len(c) for c in completions]


# name -> (trainer kind, GRPO num_generations, per_device_train_batch_size, adapter keyword arguments or None for
# the stock trainer, config overrides)
ACCUM = {"steps_per_generation": 2, "gradient_accumulation_steps": 2, "loss_type": "grpo"}   # split-independent loss
TWICE = {"num_iterations": 2}   # step 2 reuses step 1's generation: the old policy's pass runs
CASES = {
    "grpo_stock": ("stock", 3, 6, None, TWICE),
    "grpo_flex": ("flex", 3, 6, {}, TWICE),
    "grpo_budget": ("flex", 3, 6, {"flexgroup_budget": 128}, TWICE),
    "grpo_budget_unreduced": ("flex", 3, 6, {"flexgroup_budget": 128}, TWICE),   # broken on purpose: no average
    "grpo_accum_stock": ("stock", 3, 3, None, ACCUM),                  # 2 micro-batches of one group each
    "grpo_accum_budget": ("flex", 3, 3, {"flexgroup_budget": 128}, ACCUM),
    "grpo_split_stock": ("stock", 4, 6, None, {}),    # 12 rows a step: the second prompt's 4 rows straddle ranks
    "grpo_split_flex": ("flex", 4, 6, {}, {}),
    "dpo_stock": ("dpo_stock", 0, 2, None, {}),
    "dpo_flex": ("dpo_flex", 0, 2, {}, {}),
}
CASES.update({f"fsdp_{k}": v for k, v in CASES.items() if k in ("grpo_stock", "grpo_flex", "dpo_stock", "dpo_flex")})
# FSDP2 through the Trainer's own arguments (what accelerate's fsdp_config gives it), every decoder layer a unit
FSDP = dict(fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                            "reshard_after_forward": True})


def _fsdp_on_cpu() -> None:
    """accelerate (1.16) enables its FSDP plugin only for accelerator devices (MULTI_GPU, MULTI_XPU, ...), not
    for MULTI_CPU: set the state as it does there, so that the Trainer shards the model with FSDP2 on gloo."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = patched


def _grpo(name, rank, out):
    import datasets
    import trl
    from _trainers import word_tokenizer

    from flexgroup.integrations import trl as adapter
    from flexgroup.integrations.trl import FlexGroupGRPOTrainer

    kind, G, per_device, kw, cfg = CASES[name]
    g = torch.Generator().manual_seed(4)
    n_prompts = 2 * WORLD * per_device * cfg.get("steps_per_generation", 1) // G   # two optimizer steps of prompts
    ds = datasets.Dataset.from_dict({"prompt": [_words(g, 130 + 9 * i) for i in range(n_prompts)]})
    args = trl.GRPOConfig(**{**dict(
        output_dir=str(out / name), per_device_train_batch_size=per_device, num_generations=G,
        max_completion_length=8, steps_per_generation=1, gradient_accumulation_steps=1, num_iterations=1,
        beta=0.1, max_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, seed=0, bf16=False, fp16=False, max_grad_norm=1.0, disable_dropout=True, temperature=0.7,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
        **(FSDP if name.startswith("fsdp_") else {})), **cfg})
    base = trl.GRPOTrainer if kind == "stock" else FlexGroupGRPOTrainer
    cls = type("T", (Steps, base), {})
    extra = {} if kw is None else dict(kw, flexgroup_backend="sdpa")
    trainer = cls(model=str(out / "model"), reward_funcs=_reward, args=args, train_dataset=ds,
                  processing_class=word_tokenizer(), **extra)
    _fix_generations(trainer, rank)
    real = adapter.average_gradients
    if name.endswith("_unreduced"):
        adapter.average_gradients = lambda module: 0
    try:
        trainer.train()
    finally:
        adapter.average_gradients = real
    return trainer


def _dpo(name, rank, out):
    import datasets
    import trl
    from _trainers import word_tokenizer
    from transformers import AutoModelForCausalLM

    from flexgroup.integrations.trl_dpo import FlexGroupDPOTrainer

    kind, _, per_device, kw, _ = CASES[name]
    g = torch.Generator().manual_seed(2)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(2 * WORLD * per_device):
        rows["prompt"].append(_words(g, 9 + 3 * i) + " ")
        rows["chosen"].append(_words(g, 2 + i % 4) + " ")
        rows["rejected"].append(_words(g, 5 - i % 3) + " ")
    args = trl.DPOConfig(
        output_dir=str(out / name), per_device_train_batch_size=per_device, gradient_accumulation_steps=1,
        max_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        seed=0, bf16=False, fp16=False, beta=0.1, max_grad_norm=1.0,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
        **(FSDP if name.startswith("fsdp_") else {}))
    ref = AutoModelForCausalLM.from_pretrained(out / "ref", dtype=torch.float32, attn_implementation="sdpa")
    base = trl.DPOTrainer if kind == "dpo_stock" else FlexGroupDPOTrainer
    cls = type("T", (Steps, base), {})
    extra = {} if kw is None else dict(kw, flexgroup_backend="sdpa")
    trainer = cls(model=str(out / "model"), ref_model=ref, args=args, train_dataset=datasets.Dataset.from_dict(rows),
                  processing_class=word_tokenizer(), **extra)
    trainer.train()
    return trainer


def _average(rank: int, out: Path) -> None:
    """``average_gradients`` alone: a float64 and a float32 parameter with gradients on both ranks, one with
    a gradient on rank 1 only, one with none anywhere; saves each gradient before and after."""
    import torch.distributed as dist

    from flexgroup.integrations.trl_stream import average_gradients

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    m = torch.nn.Module()
    m.a, m.b = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(2, 2))
    m.c, m.d = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(1))
    m.e = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    g = torch.Generator().manual_seed(rank)
    m.a.grad = torch.randn(3, generator=g, dtype=torch.float64)
    m.b.grad = torch.randn(2, 2, generator=g)
    if rank == 1:
        m.c.grad = torch.randn(4, generator=g)
    before = {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}
    count = average_gradients(m)
    after = {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}
    torch.save({"before": before, "after": after, "count": count}, out / f"average.rank{rank}.pt")


def _worker(rank: int, world: int, outdir: str, cases: list[str]) -> None:
    os.environ.update(TOKENIZERS_PARALLELISM="false")
    out = Path(outdir)
    if any(c.startswith("fsdp_") for c in cases):
        _fsdp_on_cpu()
    for name in cases:
        if name == "average":
            _average(rank, out)
            continue
        save_run(lambda: (_dpo if CASES[name][0].startswith("dpo") else _grpo)(name, rank, out),
                 out / f"{name}.rank{rank}.pt")


def save_run(train, path: Path) -> None:
    """Run ``train()`` (returns the trained trainer) and save what the tests compare to ``path``."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train()
    res = {"steps": trainer.steps, "distributed_type": str(trainer.accelerator.distributed_type),
           "wrapped": type(trainer.model_wrapped).__name__,
           "weights": {n: _full(p) for n, p in trainer.model.named_parameters()},
           "warnings": [str(w.message) for w in caught if "flexgroup" in str(w.message)]}
    if hasattr(trainer, "flexgroup_stats"):
        res["stats"] = {k: dict(v) for k, v in trainer.flexgroup_stats.items()}
        res["groups"] = dict(getattr(trainer, "flexgroup_groups", {}))
        res["report"] = trainer.flexgroup_report()
    torch.save(res, path)


def main(outdir: str, cases: list[str]) -> None:
    spawn_ranks(_worker, WORLD, (outdir, cases), collective_timeout=120, deadline=300)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
