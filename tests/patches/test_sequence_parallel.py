"""Ulysses sequence parallelism (``patch(model, sequence_parallel=group)``, ``model_inputs(shard=group)``,
``logprobs(logits, shard=group)``) on CPU with gloo: 2 ranks by default, 4 ranks and FSDP2 (slow).

The ranks run in a fresh interpreter (``python tests/patches/test_sequence_parallel.py OUTDIR WORLD``,
which spawns them with ``tests/_gloo.spawn_ranks``: no port race, a failed or hung rank stops all); every
case runs in one spawn per world size, because
starting the processes costs far more than the tiny models. Each rank computes its part of the
log-probs and of a loss ``(lp * w[:, None]).sum()``; the workers all-reduce (sum) the log-probs, the
losses and every parameter gradient over the group and save them. The parent compares them with

- the single-process grouped run (the same batch unsharded through a patched copy), and
- each sequence alone through a stock, unpatched copy (the independent oracle),

log-probs AND every parameter gradient, float64 (``KeepFloat64``, 1e-10) and float32. A broken variant
(no all-to-all: each rank attends only to its own slice) must fail the same comparison. The loud cases
(head counts, ranks on different rows, a model patched without or for another group, a KV cache) are
checked for their error messages.

FSDP2 on a 2 x 2 mesh (data-parallel x sequence-parallel, HSDP), gradient checkpointing, LoRA: every
rank's loss is ``sp_size * (lp * w).sum()``. FSDP averages gradients over all ``dp * sp`` ranks, and
the ``sp`` ranks of a replica together hold one replica's gradient, so the ``sp_size`` factor makes the
averaged gradient the gradient of the mean over replicas of each replica's loss (docs/distributed.md).
"""

from __future__ import annotations

import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parents[1]
for _p in (TESTS, TESTS.parent):  # the worker interpreter imports conftest's helpers and this checkout's flexgroup
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
from conftest import KeepFloat64, precision  # noqa: E402
from _gloo import run_harness, server_store, spawn_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

F64, F32 = torch.float64, torch.float32
# (prompt, [responses]): 49 tokens, padded to 50 (2 ranks) / 52 (4 ranks). The third response of group 0
# starts at token 25, the first token of rank 1 of 2: it is predicted from the prompt's last token on rank 0.
# The prompt crosses the tiny Mamba2 chunk (16).
SIZES = [(21, [4, 3, 9]), (6, [4, 2])]
# name -> (arch, dtype, kind); kind "groups" (from_groups) or "tree" (from_sequences, mid-turn branches)
CASES = {
    "llama-f64": ("llama", F64, "groups"), "llama-f32": ("llama", F32, "groups"),
    "qwen2-window-f64": ("qwen2", F64, "groups"), "qwen2-window-f32": ("qwen2", F32, "groups"),
    "qwen3_5_text-f64": ("qwen3_5_text", F64, "groups"), "qwen3_5_text-f32": ("qwen3_5_text", F32, "groups"),
    "bamba-f64": ("bamba", F64, "groups"), "bamba-f32": ("bamba", F32, "groups"),
    "llama-tree-f64": ("llama", F64, "tree"), "bamba-tree-f64": ("bamba", F64, "tree"),
    "qwen3_5_text-tree-f64": ("qwen3_5_text", F64, "tree"),
    "falcon_h1-f64": ("falcon_h1", F64, "groups"),     # attention and a Mamba2 mixer side by side
}
# 4 ranks (slow): KV heads, GDN key heads and Mamba2 groups are replicated; the other hybrids too
EXTRA4 = {f"{a}-f64": (a, F64, "groups") for a in ("qwen3_next", "granitemoehybrid", "nemotron_h", "olmo_hybrid",
                                                  "gemma2")}
CASES4 = ["llama-f64", "qwen2-window-f64", "qwen3_5_text-f64", "bamba-f64", "bamba-tree-f64", "falcon_h1-f64",
          *EXTRA4]
ALL = {**CASES, **EXTRA4}
VOCAB = 128  # flexgroup.models.zoo's tiny vocabulary


def _data() -> dict:
    """Groups and a tree of multi-turn sequences with branches inside turns, and their loss weights."""
    g = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(3, VOCAB, (n,), generator=g)  # noqa: E731
    prompts = [ids(p) for p, _ in SIZES]
    responses = [[ids(n) for n in rs] for _, rs in SIZES]
    turn1, turn2 = ids(18), ids(12)
    seqs = [torch.cat([turn1, turn2, ids(7)]),
            torch.cat([turn1[:11], ids(9)]),                 # branches inside turn 1
            torch.cat([turn1, turn2[:5], ids(6)]),           # branches inside turn 2
            torch.cat([turn1, turn2, ids(3)])]
    masks = []
    for s in seqs:  # loss on everything after the first 8 tokens (a system prompt), none on tokens 14..15
        m = torch.arange(len(s)) >= 8
        m[14:16] = False
        masks.append(m)
    n_groups = sum(len(r) for _, r in SIZES)
    return {"prompts": prompts, "responses": responses, "w_groups": torch.linspace(-1.0, 1.5, n_groups),
            "seqs": seqs, "masks": masks, "w_tree": torch.tensor([0.5, -1.0, 2.0, 1.0])}


def _batch(data, kind):
    from flexgroup import GroupedBatch

    if kind == "groups":
        return GroupedBatch.from_groups(data["prompts"], data["responses"]), data["w_groups"]
    return GroupedBatch.from_sequences(data["seqs"], data["masks"]), data["w_tree"]


def _model(arch, dtype, **overrides):
    from flexgroup.models.zoo import build_model

    return build_model(arch, dtype=dtype, **overrides)


def _lora_model():
    """The tiny Llama with LoRA (non-zero B, so every LoRA weight gets a gradient), seeded on every process."""
    import peft

    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                          init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return peft.get_peft_model(_model("llama", F32), cfg)


def _ctx(dtype):
    return precision(dtype)[0]


# ------------------------------------------------------------------------------------------ worker side
def _summed(t, group):
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def _sharded_run(model, batch, w, group, needed_only=False):
    out = model(**batch.model_inputs(shard=group, needed_logits_only=needed_only))
    lp = batch.logprobs(out.logits, shard=group)
    loss = (lp * w.to(lp.dtype)[:, None]).sum()
    loss.backward()
    return lp, loss


def _case(name, group, data, needed_only=False):
    import flexgroup
    from flexgroup.models.zoo import unavailable

    arch, dtype, kind = ALL[name]
    if unavailable(arch):  # e.g. hybrids on the oldest supported transformers
        return {"skipped": unavailable(arch)}
    with _ctx(dtype):
        model = _model(arch, dtype)
        flexgroup.patch(model, sequence_parallel=group)
        batch, w = _batch(data, kind)
        lp, loss = _sharded_run(model, batch, w, group, needed_only)
    return {"lp": _summed(lp, group), "loss": _summed(loss, group), "rank_lp": lp.detach(),
            "grads": {n: _summed(p.grad, group) for n, p in model.named_parameters()}}


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the parent checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def _loud_cases(group, data, world) -> dict:
    import flexgroup
    from flexgroup import GroupedBatch

    batch, _ = _batch(data, "groups")
    out = {}
    heads = 3 if world == 2 else 6  # head_dim 16
    odd = _model("llama", F32, hidden_size=16 * heads, num_attention_heads=heads, num_key_value_heads=heads // 3)
    out["heads"] = _error(lambda: flexgroup.patch(odd, sequence_parallel=group))
    model = flexgroup.patch(_model("llama", F32), sequence_parallel=group)
    other, _ = _batch(data, "tree")
    rank = dist.get_rank(group)
    out["layout"] = _error(lambda: model(**(other if rank == 1 else batch).model_inputs(shard=group)))
    out["cache"] = _error(lambda: model(**{**batch.model_inputs(shard=group), "use_cache": True}))
    plain = flexgroup.patch(_model("llama", F32))
    out["unpatched"] = _error(lambda: plain(**batch.model_inputs(shard=group)))
    sub = dist.new_group(list(range(world)))  # the same ranks, another group object
    out["other_group"] = _error(lambda: model(**batch.model_inputs(shard=sub)))
    # shard= forgotten on the read: a rank's slice of a row whose needed-logit count equals the slice length
    # (prompt 6, responses 4 + 4 on 2 ranks: 7 and 7) used to be read as needed-only logits, silently wrong
    rs = data["responses"][0]
    twin = GroupedBatch.from_groups([data["prompts"][0][:6]], [[rs[0], rs[2][:4]]])
    with torch.no_grad():
        out["unsharded_read_same_count"] = _error(lambda: twin.logprobs(model(**twin.model_inputs(shard=group)).logits))
        out["unsharded_read"] = _error(lambda: batch.logprobs(model(**batch.model_inputs(shard=group)).logits))
    return out


def _broken_case(group, data):
    """No all-to-all: each rank runs plain causal attention over its own slice only."""
    import torch.nn.functional as F

    from flexgroup.kernels import ulysses

    def local_only(backend, plan, q, k, v, scale, group, what=""):
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              is_causal=True, scale=scale)

    right = ulysses.attention
    ulysses.attention = local_only
    try:
        return _case("llama-f64", group, data)
    finally:
        ulysses.attention = right


def _fsdp_case(rank, world, data) -> dict:
    """HSDP on a (dp=2, sp=2) mesh, LoRA, non-reentrant gradient checkpointing, float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import flexgroup
    from flexgroup import GroupedBatch

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    dp, sp = mesh["dp"].get_local_rank(), mesh["sp"].get_group()
    model = _lora_model()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    flexgroup.patch(model, sequence_parallel=sp)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    prompts, responses = data["fsdp"][dp]
    batch = GroupedBatch.from_groups(prompts, responses)
    lp = batch.logprobs(model(**batch.model_inputs(shard=sp)).logits, shard=sp)
    loss = dist.get_world_size(sp) * (lp * data["fsdp_w"][dp][:, None]).sum()   # the mesh scaling (docstring)
    loss.backward()
    return {"grads": {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None}, "lp": _summed(lp, sp), "dp": dp}


def _fsdp_unavailable() -> str | None:
    try:
        import peft  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        return str(e)
    if not hasattr(torch.cpu.current_stream(), "record_event"):
        return "this torch's FSDP2 cannot run on CPU (torch.cpu.Stream.record_event is missing)"
    return None


def _worker(rank: int, world: int, outdir: str) -> None:
    out = Path(outdir)
    result = {}
    try:
        data = torch.load(out / "data.pt")
        group = dist.group.WORLD
        for name in (CASES if world == 2 else CASES4):
            result[name] = _case(name, group, data)
        if world == 2:
            result["needed_only"] = _case("llama-f32", group, data, needed_only=True)
        result["broken"] = _broken_case(group, data)
        result["loud"] = _loud_cases(group, data, world)
        if world == 4:
            why = _fsdp_unavailable()
            result["fsdp"] = {"skipped": why} if why else _fsdp_case(rank, world, data)
    except Exception:  # noqa: BLE001 - reported to the parent
        result["crash"] = traceback.format_exc()
    torch.save(result, out / f"rank{rank}.pt")
    if "crash" in result:
        raise RuntimeError(f"rank {rank} crashed:\n{result['crash']}")   # stops the other ranks now


def _main(outdir: str, world: int) -> None:
    # a hung collective fails after 180 s instead of waiting; 4 ranks of every hybrid take minutes on 2 busy cores
    spawn_ranks(_worker, world, (outdir,), collective_timeout=180, deadline=540)


# ------------------------------------------------------------------------------------------ parent side
def _spawn(world: int, tmp: Path) -> list[dict]:
    data = _data()
    if world == 4:
        g = torch.Generator().manual_seed(11)
        data["fsdp"] = [([torch.randint(3, VOCAB, (p,), generator=g) for p, _ in sizes],
                         [[torch.randint(3, VOCAB, (n,), generator=g) for n in rs] for _, rs in sizes])
                        for sizes in ([(9, [5, 3])], [(13, [2, 6, 4])])]
        data["fsdp_w"] = [torch.tensor([1.0, -0.5]), torch.tensor([0.5, 1.5, -1.0])]
    torch.save(data, tmp / "data.pt")
    run_harness([__file__, str(tmp), str(world)], timeout=600)
    results = [torch.load(tmp / f"rank{r}.pt") for r in range(world)]
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"
    return [data] + results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _spawn(2, tmp_path_factory.mktemp("sp2"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _spawn(4, tmp_path_factory.mktemp("sp4"))


def _references(name, data):
    """(grouped lp, grouped grads, oracle lp, oracle grads) of a case, single process."""
    import copy

    import flexgroup
    from flexgroup.reference.oracle import logprobs_alone

    arch, dtype, kind = ALL[name]
    with _ctx(dtype):
        model = _model(arch, dtype)
        stock = copy.deepcopy(model)
        flexgroup.patch(model)
        batch, w = _batch(data, kind)
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        (lp * w.to(dtype)[:, None]).sum().backward()
        ref = torch.zeros_like(lp)
        if kind == "groups":
            i = 0
            for p, rs in zip(data["prompts"], data["responses"]):
                for r in rs:
                    ref[i, :len(r)] = logprobs_alone(stock, torch.cat([p, r]))[len(p) - 1:]
                    i += 1
        else:
            for i, (s, m) in enumerate(zip(data["seqs"], data["masks"])):
                ref[i, 1:len(s)] = logprobs_alone(stock, s) * m[1:]
        (ref * w.to(dtype)[:, None]).sum().backward()
    grads = lambda m: {n: p.grad for n, p in m.named_parameters()}  # noqa: E731
    return lp.detach(), grads(model), ref.detach(), grads(stock)


def _assert_close(got: dict, lp, grads, atol: float, rel: float, what: str):
    err = (got["lp"] - lp).abs().max().item()
    assert err <= atol, f"{what}: log-prob error {err:.3g} > {atol}"
    assert got["grads"].keys() == grads.keys()
    for n, g in grads.items():
        scale, gerr = g.abs().max().item(), (got["grads"][n] - g).abs().max().item()
        assert gerr <= rel * max(scale, 1e-30), f"{what}: {n}: grad error {gerr:.3g} vs scale {scale:.3g}"


def _check_case(name, data, got):
    if "skipped" in got:
        pytest.skip(got["skipped"])
    dtype = ALL[name][1]
    _, atol, rel = precision(dtype)
    lp, grads, ref, ref_grads = _references(name, data)
    tight = (1e-10, 1e-10) if dtype == F64 else (1e-5, 1e-4)
    _assert_close(got, lp, grads, *tight, "sharded vs single-process grouped")
    _assert_close(got, ref, ref_grads, atol, rel, "sharded vs each sequence alone")


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_single_process_and_each_sequence_alone(two_ranks, name):
    data, r0, r1 = two_ranks
    _check_case(name, data, r0[name])
    assert torch.equal(r0[name]["lp"], r1[name]["lp"])


def test_each_token_is_counted_on_exactly_one_rank(two_ranks):
    data, r0, r1 = two_ranks
    a, b = r0["llama-f64"]["rank_lp"], r1["llama-f64"]["rank_lp"]
    assert not ((a != 0) & (b != 0)).any()
    # the third response of group 0 starts on rank 1; its first token is predicted on rank 0
    assert a[2, 0] != 0 and b[2, 0] == 0 and b[2, 1] != 0


def test_needed_logits_only_gives_the_same_sharded_result(two_ranks):
    data, r0, _ = two_ranks
    assert (r0["needed_only"]["lp"] - r0["llama-f32"]["lp"]).abs().max() <= 1e-6
    for n, g in r0["llama-f32"]["grads"].items():
        assert (r0["needed_only"]["grads"][n] - g).abs().max() <= 1e-6 * max(g.abs().max(), 1e-30)


def test_attention_without_all_to_all_is_caught(two_ranks):
    data, r0, _ = two_ranks
    with pytest.raises(AssertionError, match="log-prob error"):
        _check_case("llama-f64", data, r0["broken"])


@pytest.mark.parametrize("case, message", [
    ("heads", "3 heads across ranks, but 3 is not divisible by 2"),
    ("layout", "rank 1 holds other layout"),
    ("cache", "KV cache"),
    ("unpatched", "patched without sequence parallelism"),
    ("other_group", "another process group"),
    ("unsharded_read_same_count", "batch.logprobs(logits, shard=group)"),
    ("unsharded_read", "batch.logprobs(logits, shard=group)"),
])
def test_loud_where_it_cannot_be_exact(two_ranks, case, message):
    for r in two_ranks[1:]:
        assert message in r["loud"][case], r["loud"][case]


def test_one_rank_group_in_process_deep_copies_and_unpatches():
    """A world of 1 (no spawn): sharded equals unsharded, a deep copy shares the group (a ProcessGroup cannot be
    copied), and unpatching the copy leaves the original patched."""
    import copy

    import flexgroup
    from flexgroup.patches import sequence_parallel as sp

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=server_store(1), rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        batch, w = _batch(_data(), "groups")
        model = flexgroup.patch(_model("llama", F32), sequence_parallel=group)
        whole = batch.logprobs(model(**batch.model_inputs()).logits)
        sharded = batch.logprobs(model(**batch.model_inputs(shard=group)).logits, shard=group)
        # bit for bit: the sharded row is the whole one plus padding tokens (a tree of their own), and the lse
        # backend's numbers for a sequence depend on its own path alone (docs/batch-invariance.md)
        assert torch.equal(whole, sharded), (whole - sharded).abs().max()
        twin = copy.deepcopy(model)
        assert sp.group_of(twin.model) is group
        flexgroup.unpatch(twin)
        assert sp.group_of(twin.model) is None and sp.group_of(model.model) is group
        with pytest.raises(ValueError, match="patched without sequence parallelism"):
            flexgroup.patch(twin)(**batch.model_inputs(shard=group))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES4)
def test_four_ranks_equal_single_process_and_each_sequence_alone(four_ranks, name):
    data, *rs = four_ranks
    _check_case(name, data, rs[0][name])


@pytest.mark.slow
def test_four_ranks_refuse_six_heads_and_catch_the_broken_variant(four_ranks):
    data, *rs = four_ranks
    assert "6 heads across ranks, but 6 is not divisible by 4" in rs[0]["loud"]["heads"]
    assert "rank 1 holds other layout" in rs[2]["loud"]["layout"]
    with pytest.raises(AssertionError, match="log-prob error"):
        _check_case("llama-f64", data, rs[0]["broken"])


@pytest.mark.slow
def test_fsdp2_on_a_dp_by_sp_mesh_with_lora_and_checkpointing(four_ranks):
    """Every rank's full LoRA gradient equals the gradient of the mean over the two data-parallel
    replicas of each replica's loss, each sequence alone through the stock model."""
    data, *rs = four_ranks
    if "skipped" in rs[0]["fsdp"]:
        pytest.skip(rs[0]["fsdp"]["skipped"])
    stock = _lora_model()
    stock.train()
    from flexgroup.reference.oracle import logprobs_alone

    total = 0
    for (prompts, responses), w in zip(data["fsdp"], data["fsdp_w"]):
        lps = [logprobs_alone(stock, torch.cat([p, r]))[len(p) - 1:] for p, rs_ in zip(prompts, responses)
               for r in rs_]
        total = total + sum(wi * lp.sum() for wi, lp in zip(w, lps)) / 2
    total.backward()
    ref = {n: p.grad for n, p in stock.named_parameters() if p.grad is not None}
    assert ref and all("lora" in n for n in ref)
    for r, res in enumerate(rs):
        got = res["fsdp"]["grads"]
        assert got.keys() == ref.keys()
        for n, g in ref.items():
            err = (got[n] - g).abs().max().item()
            assert err <= 1e-4 * g.abs().max().item(), f"rank {r}: {n}: grad error {err:.3g}"


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]))
