"""FSDP2: a patched model under ``torch.distributed.fsdp.fully_shard``, 2 CPU processes (gloo, loopback).

Each rank packs its own groups into one row and runs the grouped forward+backward of a GRPO-style
loss on the sharded model (patched before sharding, and separately patched after sharding); FSDP2
averages the gradients over ranks. Oracle (single process, in the
test itself): every ``[P; R_i]`` alone through the stock, unpatched model, loss averaged over the
ranks' data. Compared: each rank's loss and every full (unsharded) parameter gradient, float32.

The workers run in a fresh interpreter (``python tests/patches/test_fsdp.py OUTDIR``, which spawns the two
ranks with ``tests/_gloo.spawn_ranks``: no port race, a failed or hung rank stops all with its stack), so
pytest's import mode and the parent's threads do not matter.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for _gloo when run as a script
from _gloo import run_harness, spawn_ranks  # noqa: E402

WORLD = 2
ORDERS = ("patch_then_shard", "shard_then_patch")
# per rank: (prompt_len, [response_lens]); several groups in one row, different lengths per rank
RANK_GROUPS = [
    [(9, [5, 3, 7]), (4, [2, 6])],
    [(13, [1, 8]), (6, [4, 4, 2])],
]


def _fsdp_api():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6 public path
    except ImportError:  # pragma: no cover
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    return fully_shard, init_device_mesh


def _worker(rank: int, world: int, outdir: str) -> None:
    import transformers

    import flexgroup
    from flexgroup import GroupedBatch

    fully_shard, init_device_mesh = _fsdp_api()
    out = Path(outdir)
    data = torch.load(out / "data.pt")
    prompts, responses, adv = data["prompts"][rank], data["responses"][rank], data["advantages"][rank]
    batch = GroupedBatch.from_groups(prompts, responses)
    mesh = init_device_mesh("cpu", (WORLD,))
    result = {"tokens": batch.num_tokens}
    for order in ORDERS:
        model = transformers.AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32,
                                                                  attn_implementation="sdpa")
        model.train()
        if order == "patch_then_shard":
            flexgroup.patch(model, backend="sdpa")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if order == "shard_then_patch":
            flexgroup.patch(model, backend="sdpa")
        logits = model(**batch.model_inputs()).logits
        lp = batch.logprobs(logits)                   # [N, max_len], zero on padding
        loss = (lp * adv[:, None]).sum()
        loss.backward()
        result[order] = {"loss": loss.detach(),
                         "grads": {n: p.grad.full_tensor().detach().clone()
                                   for n, p in model.named_parameters() if p.grad is not None}}
    torch.save(result, out / f"rank{rank}.pt")


def _main(outdir: str) -> None:
    spawn_ranks(_worker, WORLD, (outdir,))


@pytest.mark.slow
def test_fsdp2_grouped_grads_equal_single_process_baseline(tmp_path, tiny_model, hf_oracle, groups):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    try:
        _fsdp_api()
    except ImportError:
        pytest.skip("this torch has no FSDP2 (fully_shard)")
    if not hasattr(torch.cpu.current_stream(), "record_event"):
        # torch 2.6's FSDP2 records events on the CPU stream, which has no record_event there
        pytest.skip("this torch's FSDP2 cannot run on CPU (torch.cpu.Stream.record_event is missing)")
    model = tiny_model("llama", torch.float32)
    model.save_pretrained(tmp_path / "model")
    data = {"prompts": [], "responses": [], "advantages": []}
    for r, sizes in enumerate(RANK_GROUPS):
        p, rs = groups(sizes, seed=10 + r)
        n = sum(len(x) for x in rs)
        data["prompts"].append(p)
        data["responses"].append(rs)
        data["advantages"].append(torch.linspace(-1.0, 1.5, n) * (r + 1))
    torch.save(data, tmp_path / "data.pt")

    run_harness([__file__, str(tmp_path)])

    # oracle: the stock, unpatched model, each [P; R_i] alone, loss averaged over the ranks' data
    stock = hf_oracle.stock_copy(model).train()
    losses = []
    for r in range(WORLD):
        _, lps = hf_oracle.run(stock, data["prompts"][r], data["responses"][r])
        losses.append(hf_oracle.loss(lps, data["advantages"][r].tolist()))
    (sum(losses) / WORLD).backward()
    ref = hf_oracle.grads(stock)
    assert len(ref) == len(list(model.parameters()))
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt")
        baseline_tokens = sum(p + x for p, rs in RANK_GROUPS[r] for x in rs)
        assert got["tokens"] < baseline_tokens
        for order in ORDERS:
            torch.testing.assert_close(got[order]["loss"], losses[r].detach(), atol=1e-5, rtol=1e-5)
            hf_oracle.assert_grads_close(got[order]["grads"], ref, 1e-4)  # full gradients, same on every rank

if __name__ == "__main__":
    _main(sys.argv[1])
