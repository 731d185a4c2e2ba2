"""The self-checked generic path on FSDP2-sharded models: ``flexgroup.patch`` AFTER ``fully_shard``.

An Olmo2 (outside the registry: its patch runs the generic self-check) is sharded with
``fully_shard`` (each layer and the model) over 1 and 2 gloo ranks and only then patched. FSDP2
refuses ``deepcopy``, so the self-check's copy is rebuilt unsharded from the class, the config and
the all-gathered weights (:func:`flexgroup.reference.oracle.unsharded_copy`). Each rank then runs the grouped
forward+backward of a GRPO-style loss over its own groups. Oracle (the parent process): each
``[P; R_i]`` alone through the stock, unpatched model, loss averaged over the ranks (FSDP2 averages
gradients). Compared: every response log-prob, each rank's loss and every full parameter gradient
after FSDP's reduce-scatter, float64 (norms kept in float64) and float32.

Broken variants, both on the sharded model: a read-back that scores each token from the logit row
physically before its own (the comparison must fail), and an Olmo2 whose RoPE ignores ``position_ids``
(the self-check on the unsharded copy must refuse it on every rank); and a model with a module swapped
on the instance, which the class cannot rebuild, is refused naming it.

Workers: ``python tests/patches/test_fsdp_generic.py OUTDIR WORLD`` (a fresh interpreter that forks the ranks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for _gloo when run as a script
from _gloo import SUBPROCESS_TIMEOUT, spawn_ranks  # noqa: E402

WORLDS = (1, 2)
DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOL = {"float64": (1e-12, 1e-10), "float32": (2e-5, 1e-4)}  # (log-prob / loss abs, gradient rel to max)
RANK_GROUPS = [[(9, [5, 3, 7]), (4, [2, 6])], [(13, [1, 8]), (6, [4, 4, 2])]]


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(rank: int, world: int, outdir: str) -> None:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    import flexgroup
    from flexgroup import GroupedBatch
    from flexgroup.patches.generic import NotSupported

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import KeepFloat64

    out = Path(outdir)
    data = torch.load(out / "data.pt")
    prompts, responses, adv = data["prompts"][rank], data["responses"][rank], data["advantages"][rank]
    batch = GroupedBatch.from_groups(prompts, responses)
    mesh = init_device_mesh("cpu", (world,))
    result = {}
    for name, dtype in DTYPES.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(out / "model", dtype=dtype,
                                                                  attn_implementation="sdpa")
        model = _shard(model.train(), mesh)
        flexgroup.patch(model)                      # after fully_shard: the generic self-check runs here
        with KeepFloat64() if dtype == torch.float64 else nullcontext():
            logits = model(**batch.model_inputs()).logits
            lp = batch.logprobs(logits)             # [N, max_len], zero on padding
            loss = (lp * adv[:, None].to(dtype)).sum()
            loss.backward()
        # broken on purpose: each token scored from the logit row physically before its own
        broken = batch.logprobs(torch.roll(logits.detach(), 1, dims=1))
        result[name] = {"lp": lp.detach(), "broken_lp": broken, "loss": loss.detach(),
                        "grads": {n: p.grad.full_tensor().detach().clone()
                                  for n, p in model.named_parameters() if p.grad is not None}}
    # a model whose RoPE ignores position_ids, sharded: the self-check on its unsharded copy refuses it
    rope_cls = type(model.model.rotary_emb)
    original = rope_cls.forward
    rope_cls.forward = lambda self, x, position_ids: original(self, x, torch.arange(position_ids.shape[-1])[None])
    try:
        bad = _shard(transformers.AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32,
                                                                       attn_implementation="sdpa"), mesh)
        flexgroup.patch(bad)
        result["refused"] = None
    except NotSupported as e:
        result["refused"] = str(e)
    finally:
        rope_cls.forward = original
    # a module swapped on the instance cannot be rebuilt from the class: refused, naming it
    odd = transformers.AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32,
                                                            attn_implementation="sdpa")
    odd.model.norm = torch.nn.LayerNorm(odd.config.hidden_size)
    try:
        flexgroup.patch(_shard(odd, mesh))
        result["odd"] = None
    except ValueError as e:
        result["odd"] = str(e)
    torch.save(result, out / f"rank{rank}.pt")


def _main(outdir: str, world: int) -> None:
    """Import once here, then fork the ranks (nothing here has started a thread pool: one thread)."""
    import transformers  # noqa: F401

    import flexgroup  # noqa: F401

    torch.set_num_threads(1)
    spawn_ranks(_worker, world, (outdir,), start_method="fork")


def _fsdp2_on_cpu() -> str | None:
    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return "this torch has no FSDP2 (fully_shard)"
    if not hasattr(torch.cpu.current_stream(), "record_event"):
        return "this torch's FSDP2 cannot run on CPU (torch.cpu.Stream.record_event is missing)"
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per world size: (data, checkpoint dir, per-rank results); both sizes run at once."""
    reason = _fsdp2_on_cpu()
    if reason:
        pytest.skip(reason)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import make_tiny, random_groups

    root = tmp_path_factory.mktemp("fsdp_generic")
    make_tiny("olmo2", torch.float64).save_pretrained(root / "model")
    outs, procs = {}, {}
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    for world in WORLDS:
        outs[world] = root / f"world{world}"
        outs[world].mkdir()
        os.symlink(root / "model", outs[world] / "model")
        data = {"prompts": [], "responses": [], "advantages": []}
        for r, sizes in enumerate(RANK_GROUPS[:world]):
            p, rs = random_groups(sizes, seed=10 + r)
            data["prompts"].append(p)
            data["responses"].append(rs)
            data["advantages"].append(torch.linspace(-1.0, 1.5, sum(len(x) for x in rs)) * (r + 1))
        torch.save(data, outs[world] / "data.pt")
        procs[world] = subprocess.Popen([sys.executable, __file__, str(outs[world]), str(world)], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
    logs = {}
    try:
        for world, proc in procs.items():
            logs[world] = proc.communicate(timeout=SUBPROCESS_TIMEOUT)[0]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    for world, proc in procs.items():
        assert proc.returncode == 0, f"FSDP2 workers ({world} ranks) failed:\n{logs.get(world, '')[-6000:]}"
    return {w: (torch.load(outs[w] / "data.pt"), root / "model",
                [torch.load(outs[w] / f"rank{r}.pt") for r in range(w)]) for w in WORLDS}


def _oracle(model_dir, data, world: int, dtype: torch.dtype):
    """Per rank: the stock model's log-probs [N, max_len] and loss; the gradient of the rank-averaged loss."""
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import KeepFloat64, Oracle

    stock = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    stock.train()
    lps, losses = [], []
    with KeepFloat64() if dtype == torch.float64 else nullcontext():
        for r in range(world):
            _, lp = Oracle.run(stock, data["prompts"][r], data["responses"][r])
            losses.append(Oracle.loss(lp, data["advantages"][r].tolist()))
            lps.append(lp)
        (sum(losses) / world).backward()
    return lps, [x.detach() for x in losses], Oracle.grads(stock)


def _lp_error(got: torch.Tensor, ref: list[torch.Tensor]) -> float:
    return max((got[i, :len(r)].double() - r.double()).abs().max().item() for i, r in enumerate(ref))


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w}rank")
@pytest.mark.parametrize("dtype", DTYPES)
def test_generic_model_patched_after_fully_shard_equals_each_sequence_alone(runs, world, dtype):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import Oracle

    data, model_dir, ranks = runs[world]
    lps, losses, grads = _oracle(model_dir, data, world, DTYPES[dtype])
    atol, rel = TOL[dtype]
    assert len(grads) == len(ranks[0][dtype]["grads"]) > 10
    for r, res in enumerate(ranks):
        got = res[dtype]
        assert _lp_error(got["lp"], lps[r]) <= atol, f"rank {r}: log-probs differ"
        assert abs(got["loss"].item() - losses[r].item()) <= atol * max(1.0, abs(losses[r].item()))
        Oracle.assert_grads_close(got["grads"], grads, rel)  # full gradients, the same on every rank
        # the broken read-back is caught by the same comparison
        assert _lp_error(got["broken_lp"], lps[r]) > 100 * atol


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w}rank")
def test_a_sharded_model_that_fails_the_self_check_is_refused_on_every_rank(runs, world):
    for res in runs[world][2]:
        assert res["refused"] is not None, "a RoPE that ignores position_ids passed the self-check"
        assert "model type 'olmo2'" in res["refused"] and "failed the generic self-check" in res["refused"]


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w}rank")
def test_a_sharded_model_the_class_cannot_rebuild_is_refused_naming_the_module(runs, world):
    for res in runs[world][2]:
        assert res["odd"] is not None and "'model.norm' is a LayerNorm" in res["odd"], res["odd"]
        assert "before fully_shard" in res["odd"]


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]))
