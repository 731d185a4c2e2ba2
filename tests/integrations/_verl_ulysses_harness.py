"""Harness for tests/integrations/test_verl_ulysses.py: flexgroup's engine with Ulysses (and on Olmo2) vs verl's stock engine.

``python tests/integrations/_verl_ulysses_harness.py OUTDIR`` forks 4 gloo ranks (after importing verl once).
Per case (:func:`cases`), flexgroup's engine runs with ``ulysses_sequence_parallel_size=SP`` (a ``dp x sp``
mesh) and verl's STOCK engine without sequence parallelism, every rank fed the batch of its SP group
(verl gives the ranks of one SP group the same data; the stock run then sees each replica's data
``SP`` times, and verl's global normalisers make its losses and averaged gradients those of the SP
run). verl's stock Ulysses step is not the oracle: it needs flash attention, which has no CPU build,
and with sdpa it is wrong (``python tests/integrations/_verl_ulysses_harness.py OUTDIR probe`` measures it
against its own SP=1 step: :func:`stock_ulysses_with_sdpa`). Rank ``r`` writes ``OUTDIR/rank{r}.pt``:
per case and engine what verl's ``forward_backward_batch`` with ``ppo_loss`` returned (every log-prob
and entropy, the micro-batch losses), every full parameter gradient, warnings and token counts.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import warnings
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _verl_harness import (_free_port, broken_engine_class, grpo_rows, multiturn_rows, register_cpu_platform,  # noqa: E402
                           run, save_model, verl_batch)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import KeepFloat64  # noqa: E402


def make_engine(cls, model_dir: Path, dtype: str, sp: int):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    mc = HFModelConfig(path=str(model_dir), load_tokenizer=False, override_config={"attn_implementation": "sdpa"},
                       use_remove_padding=True, enable_gradient_checkpointing=False)
    ec = FSDPEngineConfig(strategy="fsdp2", forward_only=False, use_torch_compile=False, model_dtype=dtype,
                          ulysses_sequence_parallel_size=sp,
                          mixed_precision={"param_dtype": dtype, "reduce_dtype": dtype, "buffer_dtype": dtype})
    engine = cls(mc, ec, FSDPOptimizerConfig(lr=1e-3), CheckpointConfig())
    engine.initialize()
    return engine


def cases():
    """(name, model, dtype, Ulysses size, rows, batch kwargs, train?), all on 4 ranks: ``sp2`` is 2 data-
    parallel replicas x 2 SP ranks, ``sp4`` one replica over 4 SP ranks (Qwen2's 2 KV heads replicated),
    ``fsdp2`` plain FSDP2 over 4 ranks (no SP)."""
    grpo6 = {"micro_batch_size_per_gpu": 6}  # micro-batches that split groups
    return [("sp2-grpo-train-fp64", "qwen2", "fp64", 2, grpo_rows, grpo6, True),
            ("sp2-grpo-train-fp32", "qwen2", "fp32", 2, grpo_rows, grpo6, True),
            ("sp2-multiturn-train-fp32", "qwen2", "fp32", 2, multiturn_rows,
             {"temperature": torch.tensor([0.7, 1.3, 1.0, 0.9] * 2)}, True),
            ("sp2-grpo-old-log-prob-fp32", "qwen2", "fp32", 2, grpo_rows, {}, False),
            ("sp4-grpo-train-fp64", "qwen2", "fp64", 4, grpo_rows, {}, True),
            ("sp4-multiturn-train-fp32", "qwen2", "fp32", 4, multiturn_rows, {}, True),
            ("olmo2-sp2-grpo-train-fp64", "olmo2", "fp64", 2, grpo_rows, {}, True),
            ("olmo2-fsdp2-grpo-train-fp64", "olmo2", "fp64", 1, grpo_rows, {}, True),
            ("olmo2-fsdp2-grpo-train-fp32", "olmo2", "fp32", 1, grpo_rows, {}, True)]


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*engine is not available.*")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        _cases(rank, Path(outdir))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(engine, data, loss_fn, dtype: str) -> dict:
    with warnings.catch_warnings(record=True) as caught, KeepFloat64() if dtype == "fp64" else contextlib.nullcontext():
        warnings.simplefilter("always")
        before = dict(vars(engine.flexgroup_stats)) if hasattr(engine, "flexgroup_stats") else None
        res = run(engine, data, loss_fn)
    res["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("flexgroup")]
    if before is not None:
        res["stats"] = {k: v - before[k] for k, v in vars(engine.flexgroup_stats).items()}
    return res


def _cases(rank: int, out: Path) -> None:
    from verl.workers.config import FSDPActorConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    from flexgroup.integrations import verl as fg_verl

    fg_verl.unregister()
    result, engines = {}, {}
    for name, model, dtype, sp, rows_fn, kw, train in cases():
        kw = dict(kw)
        temperature = kw.pop("temperature", 0.7)
        rows = rows_fn(rank // sp)             # the dp replica's data: the ranks of one SP group share it
        cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=4, ppo_mini_batch_size=len(rows),
                              ppo_micro_batch_size_per_gpu=4, use_remove_padding=True,
                              entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
        loss_fn = partial(ppo_loss, cfg) if train else None
        result[name] = {}
        for kind, cls, size in (("stock", FSDPEngineWithLMHead, 1), ("flexgroup", fg_verl.FlexGroupFSDPEngine, sp)):
            key = (kind, model, dtype, size)
            if key not in engines:
                engines[key] = make_engine(cls, out / model, dtype, size)
            data = lambda: verl_batch(rows, use_remove_padding=True, temperature=temperature, **kw)  # noqa: E731
            result[name][kind] = _run(engines[key], data(), loss_fn, dtype)
        if name == "sp2-grpo-train-fp32":
            engine = engines["flexgroup", model, dtype, sp]
            engine.__class__ = broken_engine_class()          # the same engine with a broken read-back
            result[name]["broken"] = _run(engine, data(), loss_fn, dtype)
            engine.__class__ = fg_verl.FlexGroupFSDPEngine
            try:  # a micro-batch flexgroup cannot group raises under Ulysses (the stock step would be wrong)
                _run(engine, verl_batch(rows, use_remove_padding=True, position_shift=2), None, dtype)
                result["ungroupable"] = None
            except RuntimeError as e:
                result["ungroupable"] = str(e)
    torch.save(result, out / f"rank{rank}.pt")


def stock_ulysses_with_sdpa(rank: int, out: Path) -> str:
    """What verl's own Ulysses step does on CPU (sdpa; flash attention has no CPU build). Not in the
    tests (one more engine); its result is quoted in docs/verl.md."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    rows = grpo_rows(rank // 2)
    cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=4, ppo_mini_batch_size=len(rows), ppo_micro_batch_size_per_gpu=4,
                          use_remove_padding=True, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    res = {}
    for sp in (2, 1):
        engine = make_engine(FSDPEngineWithLMHead, out / "qwen2", "fp32", sp)
        try:
            with engine.train_mode():
                res[sp] = _run(engine, verl_batch(rows, use_remove_padding=True), partial(ppo_loss, cfg), "fp32")
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
    return res


WORLD = 4


def main(outdir: str, target=None) -> None:
    """Save the checkpoints, import verl once here and fork the ranks (a spawned rank would spend
    ~16 s of CPU importing verl again; nothing here has started a thread pool: one thread)."""
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    out = Path(outdir)
    save_model(out / "qwen2")
    save_model(out / "olmo2", "Olmo2", seed=1)
    register_cpu_platform()
    import verl.workers.engine.fsdp.transformer_impl  # noqa: F401
    import verl.workers.utils.losses  # noqa: F401

    import flexgroup.integrations.verl  # noqa: F401

    mp.start_processes(target or worker, args=(WORLD, _free_port(), outdir), nprocs=WORLD, join=True,
                       start_method="fork")


def _probe(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.save(stock_ulysses_with_sdpa(rank, Path(outdir)), Path(outdir) / f"probe{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], _probe if sys.argv[2:] == ["probe"] else None)
