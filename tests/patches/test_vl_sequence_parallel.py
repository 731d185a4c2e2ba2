"""Sequence parallelism x vision-language: ``MultimodalGroupedBatch.model_inputs(shard=group)`` and
``.logprobs(logits, shard=group)`` on 2 gloo ranks (Qwen2-VL, Qwen2.5-VL, Qwen3-VL with its deepstack
features; float64 and float32).

The ranks run in a fresh interpreter (``python tests/patches/test_vl_sequence_parallel.py OUTDIR``). The batch
is built so that an image's placeholders straddle the boundary between the ranks: both ranks run the vision
tower on it and each keeps the features of its own placeholders. Each rank computes its part of the log-probs
and of a loss ``(lp * w[:, None]).sum()``; log-probs, losses and every parameter gradient (vision tower
included) are summed over the ranks and compared with each ``[P; R_i]`` alone through the stock, unpatched
model (float64 to 1e-10 with the norms kept in float64, float32 to 1e-5 / 1e-4 relative). A variant that keeps
the wrong rows of the embedded window must fail the comparison.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parents[1]
for _p in (TESTS, TESTS.parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
from conftest import Oracle, precision  # noqa: E402
from _gloo import run_harness, spawn_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

F64, F32 = torch.float64, torch.float32
CASES = {"qwen2_vl-f64": ("qwen2_vl", F64), "qwen2_vl-f32": ("qwen2_vl", F32),
         "qwen2_5_vl-f64": ("qwen2_5_vl", F64), "qwen2_5_vl-f32": ("qwen2_5_vl", F32),
         "qwen3_vl-f64": ("qwen3_vl", F64), "qwen3_vl-f32": ("qwen3_vl", F32),
         # a video's placeholders across the boundary (Qwen3-VL: its frames separated by timestamp text)
         "qwen2_5_vl-video-f64": ("qwen2_5_vl", F64), "qwen3_vl-video-f64": ("qwen3_vl", F64)}




def _data(kind: str, split: str = "image"):
    """(prompts, responses, vision, w): two groups whose packed row puts the first image across the ranks'
    boundary (the prompt's leading text is lengthened until it does); the second prompt has an image and a
    video, both on rank 1."""
    from tests.patches.test_vl import IMG, VID, Prompt

    for lead in range(1, 40):
        g = torch.Generator().manual_seed(5)
        first = Prompt(kind, g).text(lead)
        first = first.image(4, 8) if split == "image" else first.video(2, 4, 8)
        groups = [(first.text(2), [3, 4, 2]),
                  (Prompt(kind, g).text(1).image(4, 4).text(1).video(2, 4, 4).text(2), [5, 1])]
        prompts, vision = zip(*(p.build() for p, _ in groups))
        responses = [[torch.randint(3, 100, (n,), generator=g) for n in lens] for _, lens in groups]
        total = sum(len(p) + sum(len(r) for r in rs) for p, rs in zip(prompts, responses))
        c = (total + 1) // 2
        at = (prompts[0] == (IMG if split == "image" else VID)).nonzero()[:, 0]
        if at[0] < c <= at[-1]:
            w = torch.linspace(-1.0, 1.5, sum(len(r) for r in responses))
            return list(prompts), responses, list(vision), w
    raise AssertionError(f"no layout puts the {split} across the ranks' boundary")


def _batch(model, data):
    from flexgroup.data.multimodal import MultimodalGroupedBatch

    prompts, responses, vision, _ = data
    return MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)


def _summed(t, group):
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def _case(name, group):
    import flexgroup
    from tests.patches.test_vl import make_vl

    kind, dtype = CASES[name]
    why = _unavailable(kind)
    if why:
        return {"skipped": why}
    data = _data(kind, "video" if "video" in name else "image")
    with precision(dtype)[0]:
        model = flexgroup.patch(make_vl(kind, dtype), backend="sdpa", sequence_parallel=group)
        batch = _batch(model, data)
        inputs = batch.model_inputs(shard=group)
        lp = batch.logprobs(model(**inputs).logits, shard=group)
        loss = (lp * data[3].to(dtype)[:, None]).sum()
        loss.backward()
    return {"lp": _summed(lp, group), "loss": _summed(loss, group), "rank_lp": lp.detach(),
            "window": tuple(inputs["input_ids"].shape), "images": len(inputs.get("image_grid_thw", ())),
            "videos": len(inputs.get("video_grid_thw", ())),
            "grads": {n: _summed(p.grad, group) for n, p in model.named_parameters() if p.grad is not None}}


def _broken_case(group):
    """The embedded window's first rows kept instead of this rank's slice."""
    from flexgroup.patches import sequence_parallel as sp

    right = sp._keep_slice

    def first_rows(kwargs, pos, n):
        window = getattr(pos, "_flexgroup_window", None)
        if window is not None and kwargs.get("inputs_embeds") is not None:
            pos._flexgroup_window = (0,) + tuple(window[1:])
        return right(kwargs, pos, n)

    sp._keep_slice = first_rows
    try:
        return _case("qwen2_vl-f64", group)
    finally:
        sp._keep_slice = right


def _worker(rank: int, world: int, outdir: str) -> None:
    result = {}
    try:
        group = dist.group.WORLD
        for name in CASES:
            result[name] = _case(name, group)
        result["broken"] = _broken_case(group)
    except Exception:  # noqa: BLE001 - reported to the parent
        result["crash"] = traceback.format_exc()
    torch.save(result, Path(outdir) / f"rank{rank}.pt")
    if "crash" in result:
        raise RuntimeError(f"rank {rank} crashed:\n{result['crash']}")   # stops the other rank now


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("vlsp")
    run_harness([__file__, str(tmp)])
    results = [torch.load(tmp / f"rank{r}.pt") for r in range(2)]
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"
    return results


def _oracle(name):
    """Each [P; R_i] alone through the stock, unpatched model: (log-probs [N, T], every parameter gradient)."""
    from tests.patches.test_vl import _stock_inputs, make_vl

    kind, dtype = CASES[name]
    prompts, responses, vision, w = _data(kind, "video" if "video" in name else "image")
    stock = make_vl(kind, dtype)
    ctx = precision(dtype)[0]
    lps = []
    with ctx:
        for p, rs, v in zip(prompts, responses, vision):
            for r in rs:
                out = stock(**_stock_inputs(stock, p, r, v)).logits[0]
                lps.append(torch.log_softmax(out[len(p) - 1:len(p) + len(r) - 1], -1).gather(1, r[:, None])[:, 0])
        Oracle.loss(lps, w.to(dtype).tolist()).backward()
    ref = torch.zeros(len(lps), max(len(x) for x in lps), dtype=dtype)
    for i, x in enumerate(lps):
        ref[i, :len(x)] = x.detach()
    return ref, Oracle.grads(stock)


def _unavailable(kind: str) -> str | None:
    import transformers as tf

    cls = {"qwen2_vl": "Qwen2VLConfig", "qwen2_5_vl": "Qwen2_5_VLConfig", "qwen3_vl": "Qwen3VLConfig"}[kind]
    return None if hasattr(tf, cls) else f"{kind} is not in transformers {tf.__version__}"


def _check(name, got):
    if "skipped" in got:
        pytest.skip(got["skipped"])
    _, atol, rel = precision(CASES[name][1])
    ref, grads = _oracle(name)
    err = (got["lp"] - ref).abs().max().item()
    assert err <= atol, f"{name}: log-prob error {err:.3g} > {atol}"
    assert any(n.startswith("model.visual.") for n in grads)
    Oracle.assert_grads_close(got["grads"], grads, rel)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_each_sequence_alone_through_the_stock_model(two_ranks, name):
    r0, r1 = two_ranks
    _check(name, r0[name])
    assert torch.equal(r0[name]["lp"], r1[name]["lp"])


def test_an_image_across_the_boundary_runs_on_both_ranks_and_each_token_counts_once(two_ranks):
    r0, r1 = two_ranks
    a, b = r0["qwen2_vl-f64"]["rank_lp"], r1["qwen2_vl-f64"]["rank_lp"]
    assert not ((a != 0) & (b != 0)).any()
    c = (sum(len(p) + sum(len(r) for r in rs) for p, rs in zip(*_data("qwen2_vl")[:2])) + 1) // 2
    assert r0["qwen2_vl-f64"]["images"] == 1 and r1["qwen2_vl-f64"]["images"] == 2  # the split image on both
    assert r0["qwen2_vl-f64"]["videos"] == 0 and r1["qwen2_vl-f64"]["videos"] == 1
    for name in ("qwen2_5_vl-video-f64", "qwen3_vl-video-f64"):   # the split video on both ranks
        if "skipped" not in r0[name]:
            assert r0[name]["videos"] == 1 and r1[name]["videos"] == 2, name
    # each rank embeds its c tokens widened to the whole split image (rank 0 to its end, rank 1 from its start)
    assert r0["qwen2_vl-f64"]["window"][1] > c and r1["qwen2_vl-f64"]["window"][1] > c


def test_keeping_the_wrong_rows_of_the_window_is_caught(two_ranks):
    with pytest.raises(AssertionError, match="log-prob error"):
        _check("qwen2_vl-f64", two_ranks[0]["broken"])


def test_an_unknown_vision_language_model_with_shard_is_refused_naming_both_features():
    from flexgroup.data.multimodal import MultimodalGroupedBatch
    from tests.patches.test_vl import case, make_vl

    model = make_vl("qwen2_vl")
    prompts, responses, vision = case("image", "qwen2_vl")
    batch = MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)
    batch.rope = dataclasses.replace(batch.rope, model_type="some_vl")
    with pytest.raises(NotImplementedError, match="sequence parallelism x this vision-language model"):
        batch.model_inputs(shard=object())


def test_a_vl_ranks_logits_read_without_shard_are_refused_naming_it(monkeypatch):
    """A vision-language batch remembers, like a text batch, that it made a rank's inputs: the rank's logits
    read without ``shard=`` (which would be read at the wrong rows) are refused, naming ``shard=``; read with it
    they are accepted. One process, rank 0 of 2 simulated (tests/data/test_shard_reads.py does the same)."""
    from flexgroup.data import sharding
    from flexgroup.data.multimodal import MultimodalGroupedBatch
    from tests.patches.test_vl import make_vl

    prompts, responses, vision, _ = _data("qwen2_vl")
    batch = MultimodalGroupedBatch.from_groups(prompts, responses, model=make_vl("qwen2_vl"), vision=vision)
    monkeypatch.setattr(sharding, "group_rank_world", lambda group, arg="shard=": (0, 2))
    c = sharding.row_shard(batch.layout, batch.input_ids, object()).stop
    batch.model_inputs(shard=object())
    logits = torch.randn(1, c, 151, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"wrong log-probs: pass the group given to model_inputs"):
        batch.logprobs(logits)                                    # (without the memory: a bare shape error)
    assert torch.isfinite(batch.logprobs(logits, shard=object())).all()


if __name__ == "__main__":
    spawn_ranks(_worker, 2, (sys.argv[1],), collective_timeout=180)
