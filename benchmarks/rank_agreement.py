"""Cost of the ranks' agreement check (DESIGN invariant 9, :mod:`flexgroup.data.agreement`) next to a forward.

On 2 gloo ranks (CPU, 1 thread each; ``tests/_gloo.spawn_ranks``), per row length: the fingerprint of a
``GroupedBatch``'s sharded inputs (layout, ids, loss masks: ``row_shard`` minus the same call with
``checked=True``), the all-gather of the fingerprints, and one sharded forward of the "demo" Llama (hidden 256,
4 layers; no grad) with the check. Also the fingerprint of visual inputs (``pixel_values`` of Qwen2-VL's
1,176-wide patches) and of a streamed call's arguments (:func:`flexgroup.stream.shard.check_call`'s hashing).
Medians of ``--rounds`` rounds. Writes ``benchmarks/results/rank-agreement.json`` (``--out`` to change).

    python benchmarks/rank_agreement.py [--tokens 4096 16384] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _batch(tokens: int):
    """Groups of a 768-token prompt and 8 responses of 32 tokens, up to ``tokens`` tokens."""
    from flexgroup import GroupedBatch

    g = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    while sum(len(p) + sum(map(len, r)) for p, r in zip(prompts, responses)) + 1024 <= tokens:
        prompts.append(torch.randint(3, 2000, (768,), generator=g))
        responses.append([torch.randint(3, 2000, (32,), generator=g) for _ in range(8)])
    return GroupedBatch.from_groups(prompts, responses)


def _worker(rank: int, world: int, out: str, tokens: list, rounds: int) -> None:
    import torch.distributed as dist

    import flexgroup
    from flexgroup.bench.measure import median_seconds
    from flexgroup.data.agreement import Fingerprint, check_agreement
    from flexgroup.models.zoo import build_model
    from flexgroup.data.sharding import row_shard

    group = dist.group.WORLD
    model = flexgroup.patch(build_model("llama", size="demo"), sequence_parallel=group)
    rows = []
    for n in tokens:
        batch = _batch(n)
        inputs = batch.model_inputs(shard=group)
        args = (batch.layout, batch.input_ids, group)
        full = median_seconds(lambda: row_shard(*args, loss_masks=batch.response_mask), rounds, warmup=0)
        bare = median_seconds(lambda: row_shard(*args, checked=True), rounds, warmup=0)
        fp = row_shard(*args, loss_masks=batch.response_mask).agreement
        gather = median_seconds(lambda: check_agreement(fp, group, rank, world, "cpu", "bench"), rounds, warmup=0)
        with torch.no_grad():
            fwd = median_seconds(lambda: model(**inputs), rounds, warmup=1)
        rows.append({"tokens": batch.num_tokens, "fingerprint_s": full - bare, "all_gather_s": gather,
                     "forward_s": fwd, "share_of_forward": (full - bare + gather) / fwd})
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(4 * 1024, 1176, generator=g)            # 4 images of 1,024 patches (448 x 448 at 14 px)
    grids = torch.tensor([[1, 32, 32]] * 4)
    vis = median_seconds(lambda: Fingerprint.of(visual={"pixel_values": pixels, "image_grid_thw": grids}), rounds,
                         warmup=0)
    seqs = [torch.randint(3, 2000, (4096,), generator=g) for _ in range(16)]
    masks = [torch.ones(4096, dtype=torch.bool) for _ in seqs]
    call = median_seconds(lambda: Fingerprint.of(input_ids=seqs, loss_masks=masks, temperature=0.7, budget=8192),
                          rounds, warmup=0)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "what": "ranks' agreement check vs one sharded forward (2 gloo ranks, 1 thread, CPU)",
            "model": "llama demo (hidden 256, 4 layers, vocab 2048), float32, no grad", "rows": rows,
            "visual_fingerprint": {"bytes": pixels.numel() * 4, "seconds": vis},
            "stream_call_fingerprint": {"tokens": 16 * 4096, "seconds": call}}, indent=1))


def main(argv=None) -> None:
    from _gloo import spawn_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rank-agreement.json"))
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "out.json"
        spawn_ranks(_worker, 2, (str(part), a.tokens, a.rounds), deadline=1800)
        text = part.read_text()
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
