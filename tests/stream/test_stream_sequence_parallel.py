"""Streaming on a sequence-parallel model (issue 32, item 1): ``stream_backward`` / ``stream_logprobs`` with
``patch(model, sequence_parallel=group)``, every chunk sharded over 2 and 4 gloo ranks.

The ranks run in a fresh interpreter (``python tests/stream/test_stream_sequence_parallel.py OUTDIR WORLD``,
which spawns them on 127.0.0.1): one spawn per world size runs every case, since starting the processes
costs far more than the tiny models. Each rank streams the same tree under a budget of 128 tokens (a
system prompt longer than the budget, cut into pieces whose keys and values later chunks read; turns
branching mid-turn; a strict prefix; a duplicate; and a small separate tree that runs as a packed row)
with the loss ``-sum_i adv_i * sum_t lp_i[t]``; the workers all-reduce (sum) every parameter gradient
over the group and save it with the log-probs every rank got. The parent compares them with each
sequence alone through a stock, unpatched copy (the independent oracle): log-probs and every parameter
gradient, float64 (``KeepFloat64``) and float32, dense (llama), windowed (qwen2: window 8 on its upper
layer), a Mamba2 hybrid (bamba) and a Gated DeltaNet one (qwen3_5_text, 2 ranks). Broken variants (the log-prob sum's backward all-reduced too: every
gradient counted ``W`` times; the kept keys and values recorded without gradient) must fail the same
comparison. Loud cases: ranks holding different
sequences, another process group than the model's; in process (one rank): a group on a model patched
without sequence parallelism.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS.parent)]  # the rank interpreters: the test helpers, this checkout's flexgroup
from _gloo import NEEDS_GLOO, one_rank_group, ranks_main, spawn  # noqa: E402
from conftest import precision  # noqa: E402

pytestmark = NEEDS_GLOO

F64, F32 = torch.float64, torch.float32
VOCAB = 128  # flexgroup.models.zoo's tiny vocabulary
BUDGET = 128
TEMPERATURE = 0.7
CASES = {"llama-f64": ("llama", F64), "llama-f32": ("llama", F32), "qwen2-window-f64": ("qwen2", F64),
         "qwen2-window-f32": ("qwen2", F32), "bamba-f64": ("bamba", F64), "bamba-f32": ("bamba", F32),
         "qwen3_5_text-f64": ("qwen3_5_text", F64),     # Gated DeltaNet: recurrent state and conv kept by shards
         "llama-checkpointing-f32": ("llama", F32),   # non-reentrant gradient checkpointing: recomputed all-to-alls
         "llama-sparse-f64": ("llama", F64)}          # loss on the last 2 tokens: chunks where a rank scores nothing
CASES4 = ["llama-f64", "llama-f32", "qwen2-window-f64", "bamba-f64"]


def _data() -> dict:
    """A 150-token system prompt, 2 tasks with turns branching mid-turn, a strict prefix, a duplicate (one
    streamed tree of ~560 tokens), and a 43-token tree of 2 sequences that fits the budget (a packed row)."""
    rng = random.Random(0)
    toks = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    system = toks(150)
    seqs = []
    for task in range(2):
        base = system + toks(20 + 7 * task)
        t1 = toks(60)
        seqs += [base + t1 + toks(25), base + t1[:23] + toks(31), base + t1[:9]]   # mid-turn branch, strict prefix
    seqs.append(list(seqs[1]))                                                        # duplicate
    short = toks(20)
    seqs += [short + toks(9), short + toks(14)]
    seqs = [torch.tensor(s) for s in seqs]
    masks = []
    for s in seqs[:-2]:
        m = torch.tensor([rng.random() < 0.85 for _ in range(len(s))])
        m[0] = False
        masks.append(m)
    # the packed row (43 tokens) scores only its last tokens: the first rank(s) score nothing there, and their
    # backward must still run every all-to-all the other ranks' backward runs
    masks += [torch.arange(len(s)) >= len(s) - 3 for s in seqs[-2:]]
    adv = torch.linspace(-1.0, 1.5, len(seqs), dtype=F64)
    sparse = [torch.arange(len(s)) >= len(s) - 2 for s in seqs]
    return {"seqs": seqs, "masks": masks, "sparse": sparse, "adv": adv}


def _masks(name, data):
    """The case's loss masks (``sparse``: a rank whose logit rows score nothing in a chunk still runs the
    backward of every all-to-all; without that the other ranks' backward waits forever)."""
    return data["sparse"] if "sparse" in name else data["masks"]


def _model(arch, dtype):
    from flexgroup.models.zoo import build_model

    return build_model(arch, dtype=dtype)


# ------------------------------------------------------------------------------------------ worker side
def _summed(t, group):
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def _case(name, group, data):
    import flexgroup
    from flexgroup.models.zoo import unavailable

    arch, dtype = CASES[name]
    if unavailable(arch):
        return {"skipped": unavailable(arch)}
    adv = data["adv"]
    model = _model(arch, dtype)
    if "checkpointing" in name:
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    from flexgroup.stream.chunk_carrier import KeptStore

    kept, right = set(), KeptStore.keep

    def keep(self, chunk, key, orig, train):   # records the shape of every kept key tensor [1, heads, n, D]
        if key[-1] == "k":
            kept.add(orig.shape[1])
        return right(self, chunk, key, orig, train)

    KeptStore.keep = keep
    try:
        with precision(dtype)[0]:
            model = flexgroup.patch(model, sequence_parallel=group)
            res = flexgroup.stream_backward(model, data["seqs"], lambda lp, i: -(lp * adv[i, None].to(lp.dtype)).sum(),
                                            loss_masks=_masks(name, data), budget=BUDGET)
    finally:
        KeptStore.keep = right
    return {"lp": res.logprobs, "loss": res.loss, "forwards": res.forwards, "kept_heads": kept,
            "world": dist.get_world_size(group),
            "grads": {n: _summed(p.grad, group) for n, p in model.named_parameters() if p.grad is not None}}


def _logprobs_case(group, data):
    import flexgroup

    with precision(F64)[0]:
        model = flexgroup.patch(_model("llama", F64), sequence_parallel=group)
        lp, ent = flexgroup.stream_logprobs(model, data["seqs"], loss_masks=data["masks"], budget=BUDGET,
                                            temperature=TEMPERATURE, return_entropy=True)
    return {"lp": lp, "ent": ent}


def _broken_case(group, data):
    """The log-prob sum's backward all-reduced as well: each rank's tokens get W times their gradient."""
    from flexgroup.stream import shard as stream_shard

    right = stream_shard._SumOverRanks.backward

    def summed_backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad, None

    stream_shard._SumOverRanks.backward = staticmethod(summed_backward)
    try:
        return _case("llama-f64", group, data)
    finally:
        stream_shard._SumOverRanks.backward = staticmethod(right)


def _detached_case(group, data):
    """The kept keys, values and states recorded without gradient: the shared prefix misses its later chunks'."""
    from flexgroup.stream.chunk_carrier import KeptStore

    right = KeptStore.keep
    KeptStore.keep = lambda self, chunk, key, orig, train: right(self, chunk, key, orig, False)
    try:
        return _case("llama-f64", group, data)
    finally:
        KeptStore.keep = right


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the parent checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def _loud_cases(group, data) -> dict:
    import flexgroup

    model = flexgroup.patch(_model("llama", F32), sequence_parallel=group)
    seqs = list(data["seqs"])
    if dist.get_rank(group) == 1:
        seqs[0] = seqs[0].flip(0)
    loss = lambda lp, i: lp.sum()  # noqa: E731
    out = {"rows": _error(lambda: flexgroup.stream_backward(model, seqs, loss, budget=BUDGET))}
    other = dist.new_group(list(range(dist.get_world_size(group))))  # the same ranks, another group object
    out["other_group"] = _error(lambda: flexgroup.stream_logprobs(model, data["seqs"], budget=BUDGET,
                                                                  sequence_parallel=other))
    return out


def _worker(rank: int, world: int, group, data) -> dict:
    result = {name: _case(name, group, data) for name in (CASES if world == 2 else CASES4)}
    if world == 2:
        result["logprobs"] = _logprobs_case(group, data)
        result["broken"] = _broken_case(group, data)
        result["detached"] = _detached_case(group, data)
        result["loud"] = _loud_cases(group, data)
    return result


# ------------------------------------------------------------------------------------------ parent side
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(__file__, 2, tmp_path_factory.mktemp("ssp2"), _data())


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return spawn(__file__, 4, tmp_path_factory.mktemp("ssp4"), _data())


_ORACLE: dict = {}


def _alone(arch, dtype, data, temperature=1.0, masks="masks"):
    """Each sequence alone through the stock, unpatched model: (lp [N, T] masked, entropies [N, T] masked, grads
    of -sum_i adv_i * sum_t lp_i[t])."""
    key = (arch, dtype, temperature, masks)
    if key in _ORACLE:
        return _ORACLE[key]
    from flexgroup.reference.oracle import logits_alone

    seqs, masks, adv = data["seqs"], data[masks], data["adv"]
    T = max(len(s) for s in seqs)
    lp_all, ent_all = torch.zeros(len(seqs), T, dtype=F64), torch.zeros(len(seqs), T, dtype=F64)
    with precision(dtype)[0]:
        stock = _model(arch, dtype)
        for i, (s, m) in enumerate(zip(seqs, masks)):
            logp = torch.log_softmax(logits_alone(stock, s)[:-1] / temperature, -1)   # [n - 1, V]
            lp = logp.gather(1, s[1:, None])[:, 0] * m[1:]
            (-(lp.sum()) * adv[i].to(dtype)).backward()
            lp_all[i, 1:len(s)] = lp.detach().double()
            ent_all[i, 1:len(s)] = (-(logp.exp() * logp).sum(-1) * m[1:]).detach().double()
    grads = {n: p.grad for n, p in stock.named_parameters() if p.grad is not None}
    _ORACLE[key] = (lp_all, ent_all, grads)
    return _ORACLE[key]


def _check(name, data, got, every_rank=()):
    if "skipped" in got:
        pytest.skip(got["skipped"])
    arch, dtype = CASES[name]
    _, atol, rel = precision(dtype)
    ref, _, ref_grads = _alone(arch, dtype, data, masks="sparse" if "sparse" in name else "masks")
    assert got["forwards"] > 4  # streamed chunks, not one forward
    err = (got["lp"].double() - ref).abs().max().item()
    assert err <= atol, f"{name}: log-prob error {err:.3g} > {atol}"
    assert got["grads"].keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        scale, gerr = g.abs().max().item(), (got["grads"][n] - g).abs().max().item()
        assert gerr <= rel * max(scale, 1e-30), f"{name}: {n}: grad error {gerr:.3g} vs scale {scale:.3g}"
    w = got["world"]  # kept keys: this rank's share of the 2 KV heads, replicated W / gcd(2, W) times
    assert got["kept_heads"] == {2 * (w // math.gcd(2, w)) // w}, got["kept_heads"]
    for other in every_rank:  # every rank holds the whole log-probs and the same loss
        assert torch.equal(other["lp"], got["lp"]) and other["loss"] == got["loss"]


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_on_two_ranks_equals_each_sequence_alone(two_ranks, name):
    data, r0, r1 = two_ranks
    _check(name, data, r0[name], [r1[name]])


@pytest.mark.parametrize("name", CASES4)
def test_streamed_on_four_ranks_equals_each_sequence_alone(four_ranks, name):
    data, *rs = four_ranks
    _check(name, data, rs[0][name], [r[name] for r in rs[1:]])


def test_stream_logprobs_with_temperature_and_entropies_on_two_ranks(two_ranks):
    data, r0, r1 = two_ranks
    ref_lp, ref_ent, _ = _alone("llama", F64, data, TEMPERATURE)
    for r in (r0, r1):
        assert (r["logprobs"]["lp"] - ref_lp).abs().max().item() <= 1e-10
        assert (r["logprobs"]["ent"] - ref_ent).abs().max().item() <= 1e-10


@pytest.mark.parametrize("variant", ["broken", "detached"])
def test_gradients_counted_on_every_rank_or_kept_without_gradient_are_caught(two_ranks, variant):
    data, r0, _ = two_ranks
    with pytest.raises(AssertionError, match="grad error"):
        _check("llama-f64", data, r0[variant])


@pytest.mark.parametrize("case, message", [
    ("rows", "rank 1 holds other layout (the packed row's segments, or the streaming schedule), token ids"),
    ("other_group", "another process group than the one the model was patched with"),
])
def test_loud_where_ranks_or_groups_differ(two_ranks, case, message):
    for r in two_ranks[1:]:
        assert message in r["loud"][case], r["loud"][case]


@pytest.fixture
def one_rank():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with one_rank_group() as group:
        yield group


def test_refused_in_process_naming_both_features(one_rank):
    import flexgroup

    # (a Qwen-VL model streams sharded too: tests/stream/test_stream_vision_sequence_parallel.py)
    seqs = [torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 12)]
    plain = flexgroup.patch(_model("llama", F32))
    with pytest.raises(ValueError, match="patched without sequence parallelism"):
        flexgroup.stream_logprobs(plain, seqs, budget=BUDGET, sequence_parallel=one_rank)
    with pytest.raises(ValueError, match="takes the torch.distributed ProcessGroup"):
        flexgroup.stream_logprobs(plain, seqs, budget=BUDGET, sequence_parallel="sp")
    sharded = flexgroup.patch(_model("llama", F32), sequence_parallel=one_rank)
    a = flexgroup.stream_logprobs(sharded, seqs, budget=BUDGET)                          # the model's group
    b = flexgroup.stream_logprobs(sharded, seqs, budget=BUDGET, sequence_parallel=False)  # unsharded
    # bit for bit: the sharded row is padded to a multiple of the group (padding tokens: a tree of their own),
    # and the lse backend's numbers for a sequence depend on its own path alone (docs/batch-invariance.md)
    assert torch.equal(a, b), (a - b).abs().max()


if __name__ == "__main__":
    ranks_main(_worker)
