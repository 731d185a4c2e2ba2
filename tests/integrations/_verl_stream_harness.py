"""Harness for tests/integrations/test_verl_stream.py: tries bigger than the token budget, streamed by the engine.

``python tests/integrations/_verl_stream_harness.py OUTDIR WORLD`` forks ``WORLD`` (1 or 2) gloo ranks after
importing verl once. Per case (:func:`cases`) verl's STOCK engine (no sequence parallelism) and flexgroup's
engine run verl's ``forward_backward_batch`` with ``ppo_loss`` (or the forward-only pass) on the same batch:
GRPO groups whose prompt (60 tokens) and 4 responses make a trie of ~150 grouped tokens, over a dynamic-bsz
budget of 128 tokens, beside a small group that fits. On 1 rank the big tries stream; on 2 ranks
``sp2`` cases run flexgroup with ``ulysses_sequence_parallel_size=2`` (one replica: streamed, sharded) while
every stock rank gets the replica's batch (so its normalisers and averaged gradients are the SP run's), and
``dp2`` runs 2 data-parallel replicas (streaming refused: cut, one warning). Rank ``r`` writes
``OUTDIR/rank{r}.pt``: per case and engine the micro-batch losses, log-probs, entropies, metrics, every full
parameter gradient, flexgroup's warnings and counters, and the tokens entering the embedding.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import warnings
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _verl_harness import (_free_port, count_embedded_tokens, register_cpu_platform, run, save_model,  # noqa: E402
                           verl_batch)
from _verl_harness import make_engine as checkpointed_engine_rmpad  # noqa: E402  (float32: gradient checkpointing on)
from _verl_ulysses_harness import make_engine  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import KeepFloat64  # noqa: E402

VOCAB = 61
WIDTHS = (60, 30)   # padded prompt / response widths
MODELS = {"hybrid": "qwen3_5", "refused": "falcon_h1"}   # case-name prefix -> checkpoint (else qwen2)
BUDGET = 128        # max_token_len_per_gpu: flexgroup.stream.MIN_BUDGET, the smallest a stream takes


def stream_rows(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Two GRPO groups with 60-token prompts and 4 responses of 15-30 tokens (tries of ~150 grouped tokens,
    over the budget), then a small group (an 8-token prompt, 4 responses of 3-8 tokens) that fits."""
    g = torch.Generator().manual_seed(300 + seed)
    ids = lambda n: torch.randint(3, VOCAB, (n,), generator=g)  # noqa: E731
    rows = []
    for plen, lo, hi in ((60, 15, 30), (60, 15, 30), (8, 3, 8)):
        p = ids(plen)
        rows += [(p, r, torch.ones_like(r)) for r in (ids(int(torch.randint(lo, hi + 1, (1,), generator=g)))
                                                       for _ in range(4))]
    return rows


def cases(world: int):
    """(name, dtype, Ulysses size, batch kwargs, train?, entropy_coeff). ``temperature`` per sample: one per trie
    (streamed) or differing within a trie (refused)."""
    dyn = {"use_dynamic_bsz": True, "max_token_len_per_gpu": BUDGET, "calculate_entropy": False}
    if world == 1:
        return [("stream-train-fp64", "fp64", 1, dyn, True, 0.0),
                ("stream-train-fp32", "fp32", 1, dyn, True, 0.0),
                # verl's gradient checkpointing (non-reentrant): the streamed chunks' forwards are recomputed
                ("stream-checkpointing-train-fp32", "fp32", 1, dyn, True, 0.0),
                # only tries over the budget: no planned forward, the last stream's backward syncs the gradients
                ("stream-only-train-fp64", "fp64", 1, dyn, True, 0.0),
                ("stream-old-log-prob-fp32", "fp32", 1, {**dyn, "calculate_entropy": True}, False, 0.0),
                ("stream-temperature-per-trie-fp32", "fp32", 1,
                 {**dyn, "temperature": torch.tensor([0.7] * 4 + [1.3] * 4 + [1.0] * 4)}, True, 0.0),
                ("stream-temperature-within-trie-fp32", "fp32", 1,
                 {**dyn, "temperature": torch.tensor([0.7, 1.3] * 6)}, True, 0.0),
                ("stream-train-entropy-fp32", "fp32", 1, {**dyn, "calculate_entropy": True}, True, 0.01),
                ("stream-small-budget-fp32", "fp32", 1, {**dyn, "max_token_len_per_gpu": 100}, True, 0.0),
                # a Gated DeltaNet hybrid (Qwen3.5's text model): streamed (recurrent states kept across chunks)
                ("hybrid-stream-train-fp64", "fp64", 1, dyn, True, 0.0),
                # a Mamba2 hybrid that flexgroup.patch refuses on transformers 5.10: verl's stock step, one warning
                ("refused-arch-train-fp32", "fp32", 1, {"micro_batch_size_per_gpu": 4}, True, 0.01)]
    return [("sp2-stream-train-fp64", "fp64", 2, dyn, True, 0.0),
            ("sp2-stream-train-fp32", "fp32", 2, dyn, True, 0.0),
            ("sp2-stream-old-log-prob-fp32", "fp32", 2, {**dyn, "calculate_entropy": True}, False, 0.0),
            ("dp2-stream-refused-fp32", "fp32", 1, dyn, True, 0.0)]


def _run(engine, data, loss_fn, dtype: str) -> dict:
    with warnings.catch_warnings(record=True) as caught, KeepFloat64() if dtype == "fp64" else contextlib.nullcontext():
        warnings.simplefilter("always")
        before = dict(vars(engine.flexgroup_stats)) if hasattr(engine, "flexgroup_stats") else None
        embedded = engine.embedded[0]
        res = run(engine, data, loss_fn)
    res["embedded_tokens"] = engine.embedded[0] - embedded
    res["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("flexgroup")]
    if before is not None:
        res["stats"] = {k: v - before[k] for k, v in vars(engine.flexgroup_stats).items()}
    return res


def checkpointed_engine(cls, model_dir: Path, dtype: str):
    """An engine with verl's gradient checkpointing on (``enable_gradient_checkpointing``; float32 only)."""
    assert dtype == "fp32"
    return checkpointed_engine_rmpad(cls, model_dir, dtype, True)


def broken_jagged(lp, lens):
    """A broken read-back of the stream's rows, on purpose: entries ``0 .. n_i - 1`` taken from stream
    positions ``0 .. n_i - 1`` (each token's own log-prob slot shifted by one)."""
    rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    cols = torch.cat([torch.arange(0, m) for m in lens])
    return torch.nested.nested_tensor_from_jagged(lp[rows, cols], torch.tensor([0] + lens).cumsum(0))


def _cases(rank: int, world: int, out: Path) -> None:
    from verl.workers.config import FSDPActorConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    from flexgroup.integrations import verl as fg_verl
    from flexgroup.integrations import verl_stream

    fg_verl.unregister()
    result, engines = {}, {}
    for name, dtype, sp, kw, train, entropy_coeff in cases(world):
        kw = dict(kw)
        temperature = kw.pop("temperature", 0.7)
        rows = stream_rows(rank if name.startswith("dp2") else 0)   # sp2: one replica, both ranks its data
        if name.startswith("stream-only"):
            rows = rows[:8]                                          # the two big groups alone
        cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=4, ppo_mini_batch_size=len(rows),
                              ppo_micro_batch_size_per_gpu=4, use_remove_padding=True,
                              entropy_coeff=entropy_coeff, use_kl_loss=True, kl_loss_coef=0.1)
        loss_fn = partial(ppo_loss, cfg) if train else None
        # under Ulysses verl's budget per forward is max_token_len_per_gpu x sp: the SP run gets BUDGET / sp, so
        # that verl forms the same micro-batches as the stock run's BUDGET (same losses per micro-batch)
        def data(size=1, kw=kw, rows=rows, temperature=temperature):
            budget = ({"max_token_len_per_gpu": kw["max_token_len_per_gpu"] // size}
                      if "max_token_len_per_gpu" in kw else {})
            return verl_batch(rows, use_remove_padding=True, temperature=temperature, widths=WIDTHS, **{**kw, **budget})
        result[name] = {}
        model = MODELS.get(name.split("-")[0], "qwen2")
        for kind, cls, size in (("stock", FSDPEngineWithLMHead, 1), ("flexgroup", fg_verl.FlexGroupFSDPEngine, sp)):
            ckpt = "checkpointing" in name
            key = (kind, dtype, size, model, ckpt)
            if key not in engines:
                engines[key] = (checkpointed_engine(cls, out / model, dtype) if ckpt
                                else make_engine(cls, out / model, dtype, size))
                engines[key].embedded = count_embedded_tokens(engines[key])
            batch = data(size)
            if kind == "stock" and model == "qwen3_5":
                # verl's stock step packs a micro-batch's samples into one row, and transformers 5.10's Gated
                # DeltaNet carries its recurrent state across them on CPU: the oracle runs each sample alone
                batch = data(size, {**kw, "use_dynamic_bsz": False, "micro_batch_size_per_gpu": 1})
            result[name][kind] = _run(engines[key], batch, loss_fn, dtype)
        if name in ("stream-train-fp32", "sp2-stream-train-fp32"):
            jagged, verl_stream._jagged = verl_stream._jagged, broken_jagged
            try:
                result[name]["broken"] = _run(engines["flexgroup", dtype, sp, model, False], data(sp), loss_fn, dtype)
            finally:
                verl_stream._jagged = jagged
    if world == 2:  # the Gated DeltaNet hybrid under Ulysses: flexgroup.patch refuses it on transformers 5.10
        try:
            make_engine(fg_verl.FlexGroupFSDPEngine, out / "qwen3_5", "fp64", 2)
            result["hybrid-sp2"] = None
        except RuntimeError as e:
            result["hybrid-sp2"] = str(e)
    torch.save(result, out / f"rank{rank}.pt")


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*engine is not available.*")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        _cases(rank, world, Path(outdir))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def save_zoo(path: Path, name: str) -> None:
    """flexgroup's tiny ``qwen3_5`` (Qwen3.5's text model: Gated DeltaNet and attention layers) or
    ``falcon_h1`` (a Mamba2 hybrid), seeded weights."""
    from flexgroup.models.zoo import build_model

    model = build_model({"qwen3_5": "qwen3_5_text"}.get(name, name), dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)


def main(outdir: str, world: int) -> None:
    """Save the checkpoint, import verl once here and fork the ranks (one thread each)."""
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    out = Path(outdir)
    save_model(out / "qwen2")
    for name in ("qwen3_5", "falcon_h1"):
        save_zoo(out / name, name)
    register_cpu_platform()
    import verl.workers.engine.fsdp.transformer_impl  # noqa: F401
    import verl.workers.utils.losses  # noqa: F401

    import flexgroup.integrations.verl  # noqa: F401

    mp.start_processes(worker, args=(world, _free_port(), outdir), nprocs=world, join=True, start_method="fork")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
