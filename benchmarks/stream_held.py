"""What autograd holds at the peak of one P10 step: saved tensors grouped by kind at the peak moment.

    python benchmarks/stream_held.py [--workload tree] [--model llama] [--budget 2048]

Runs ``packed`` and ``stream-<budget>`` of ``flexgroup bench stream`` once each (one torch thread) under
the benchmark's saved-tensor tracker and prints, for the moment the bytes held for backward peak, the
held storages grouped as activations (last dim hidden / MLP / vocab), head-dim tensors ``[.., D]``
(q/k/v and their gathers) and other 4-D float tensors (attention masks ``[G, 1, n, keys]``), with the
largest shapes of the last group.
"""

from __future__ import annotations

import argparse
import collections

import torch

from flexgroup.bench import stream
from flexgroup.bench.measure import Held, HeldForBackward, held_peak
from flexgroup.bench import stream_workloads as wl


class _Snapshot(HeldForBackward):
    """The benchmark's tracker, also remembering the shapes of the storages alive at the peak."""

    def __init__(self, exclude):
        super().__init__(exclude)
        self.shapes: dict[int, tuple] = {}
        self.at_peak: dict[int, tuple] = {}

    def pack(self, t):
        before = self.peak
        h = super().pack(t)
        if isinstance(h, Held):
            self.shapes.setdefault(h.ptr, (tuple(t.shape), t.dtype, h.n))
            if self.peak > before:
                self.at_peak = dict(self.shapes)
        return h

    def release(self, ptr: int, n: int) -> None:
        super().release(ptr, n)
        if not self.count[ptr]:
            self.shapes.pop(ptr, None)


def _kind(shape: tuple, dtype, config) -> str:
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if len(shape) == 4 and shape[-1] == head:
        return f"[.., {head}] (q/k/v, gathers)"
    if len(shape) == 4 and dtype.is_floating_point:
        return "other 4-D float (attention masks)"
    if shape and shape[-1] in (config.hidden_size, config.intermediate_size, config.vocab_size):
        return "activations (hidden / MLP / vocab)"
    return "other"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=wl.WORKLOADS, default="tree")
    ap.add_argument("--model", choices=wl.MODELS, default="llama")
    ap.add_argument("--budget", type=int, default=2048)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    seqs, masks, w = wl.make_batch(args.workload, wl.sizes(args.workload, args.model, False))
    model = wl.build(args.model)
    cs = stream.contenders(model, seqs, masks, w, (args.budget,))
    for name in ("packed", f"stream-{args.budget}"):
        c = cs[name]
        tr = _Snapshot(list(c.model.parameters()))
        held_peak(c.step, tracker=tr)
        by: collections.Counter = collections.Counter()
        for shape, dtype, n in tr.at_peak.values():
            by[_kind(shape, dtype, model.config)] += n
        print(f"{name}: {tr.peak / 2**20:.0f} MiB held at the peak, {len(tr.at_peak)} storages")
        for kind, n in by.most_common():
            print(f"  {kind}: {n / 2**20:.0f} MiB")
        masks_ = sorted(((n, s) for s, d, n in tr.at_peak.values()
                         if _kind(s, d, model.config).startswith("other 4-D")), reverse=True)[:4]
        if masks_:
            print("  largest 4-D float shapes:", ", ".join(str(list(s)) for _, s in masks_))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
