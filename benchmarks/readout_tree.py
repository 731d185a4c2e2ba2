"""A fully scored multi-turn tree (AReaL-DTA's shape at CPU scale): the readout before and after sharing it.

    python benchmarks/readout_tree.py [--system 250 --thinking 125 --response 50 --turns 17] [--rounds 3]
                                      [--out benchmarks/results/readout-tree-1t]

The tree: turn k's trajectory is ``system + response_1 .. response_{k-1} + thinking_k + response_k`` (the
thinking of earlier turns is dropped from the history), every token but the first scored. A 2-layer Llama
(hidden 128, MLP 512, 4 / 2 heads, vocab 2048), float32, one torch thread. Contenders, timed in interleaved
rounds (median), each a forward, the log-probs and a backward of ``sum(w * lp)``:

- ``alone``: each trajectory through the stock model by itself (the repeated computation);
- ``before``: flexgroup's packed forward and the readout it had before issue 39 (one logit row copied and
  one log-softmax per read, :func:`per_read_logprobs` below, kept here only as the comparison);
- ``after``: flexgroup's packed forward and ``batch.logprobs`` (the shared readout, flexgroup/data/readout.py).

Also, on the packed row's logits alone: the readout's bytes saved for backward (distinct storages through
``saved_tensors_hooks``) against the logits' bytes, its time (forward + backward), and the largest
difference of ``after`` from ``before`` in log-probs and in the logits' gradient. The ideal is the decoder
layers' FLOP ratio (``flexgroup.bench.zoo.ideal_speedup``) and, the one each time is set against, that
ratio with the LM head counted too (rows through it: ``alone`` every scored token, flexgroup each distinct
row once; 3.11x at the default size, the issue's ideal).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.bench.harness import build_model
from flexgroup.bench.zoo import flops_per_token_and_pair, ideal_speedup

LLAMA = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=2048)


def dta_tree(system: int, thinking: int, response: int, turns: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """The trajectories, one per turn: LongTensors [system + (k - 1) * response + thinking + response]."""
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(3, vocab, (n,), generator=g)

    history, seqs = [toks(system)], []
    for _ in range(turns):
        think, resp = toks(thinking), toks(response)
        seqs.append(torch.cat(history + [think, resp]))
        history.append(resp)
    return seqs


def per_read_logprobs(batch: GroupedBatch, logits: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """The readout before issue 39, for comparison only: per scored token its logit row copied and its own
    log-softmax. ``logits`` [1, K, V] of ``model_inputs(needed_logits_only=True)`` -> [N, max_len]."""
    pred, tgt, flat = batch.read_index(logits.device, needed_only=True)
    x2 = logits[0]
    lps = []
    for a in range(0, pred.numel(), chunk):
        x = x2.index_select(0, pred[a:a + chunk])
        lps.append(x.gather(1, tgt[a:a + chunk, None])[:, 0] - torch.logsumexp(x, dim=-1))
    n, w = batch.num_responses, batch.max_len
    return x2.new_zeros(n * w).index_put((flat,), torch.cat(lps)).view(n, w)


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn()`` runs."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", type=int, default=250)
    ap.add_argument("--thinking", type=int, default=125)
    ap.add_argument("--response", type=int, default=50)
    ap.add_argument("--turns", type=int, default=17)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write STEM.json and STEM.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    seqs = dta_tree(args.system, args.thinking, args.response, args.turns, LLAMA["vocab"])
    batch = GroupedBatch.from_sequences(seqs)                       # every token but the first scored
    stock = build_model(LLAMA)
    model = flexgroup.patch(build_model(LLAMA), backend="sdpa")     # same seed: the same weights
    w = torch.linspace(-1.0, 1.0, batch.max_len)                    # a loss weight per column
    reads, rows = int(batch.response_mask.sum()), batch.logit_rows.numel()

    def alone():
        for s in seqs:
            x = stock(input_ids=s[None], use_cache=False).logits[0, :-1]
            lp = torch.log_softmax(x, -1).gather(1, s[1:, None])[:, 0]
            (lp * w[1:s.numel()]).sum().backward()

    def packed(readout):
        def step():
            logits = model(**batch.model_inputs(needed_logits_only=True)).logits
            (readout(logits) * w).sum().backward()
        return step

    steps = {"alone": alone, "before": packed(lambda x: per_read_logprobs(batch, x)),
             "after": packed(lambda x: batch.logprobs(x))}
    times = {k: [] for k in steps}
    for f in steps.values():                                        # warm-up, untimed
        f()
    for _ in range(args.rounds):                                    # interleaved rounds
        for k, f in steps.items():
            stock.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}

    # the readout alone, on fixed logits of the packed row
    with torch.no_grad():
        fixed = model(**batch.model_inputs(needed_logits_only=True)).logits
    logit_bytes = fixed.numel() * fixed.element_size()
    readout_t, lp_of, grad_of, held = {}, {}, {}, {}
    for k, read in (("before", lambda x: per_read_logprobs(batch, x)), ("after", lambda x: batch.logprobs(x))):
        x = fixed.clone().requires_grad_()
        held[k] = saved_bytes(lambda: read(x))
        ts = []
        for _ in range(args.rounds + 1):                            # the first untimed
            x.grad = None
            t0 = time.perf_counter()
            lp = read(x)
            (lp * w).sum().backward()
            ts.append(time.perf_counter() - t0)
        readout_t[k], lp_of[k], grad_of[k] = statistics.median(ts[1:]), lp.detach(), x.grad

    cfg = model.config
    ideal = ideal_speedup(cfg, batch.layout, batch.sequence_ends)
    cost = batch.layout.cost(batch.sequence_ends)
    per_tok, per_pair = flops_per_token_and_pair(cfg)
    head = 2 * cfg.hidden_size * cfg.vocab_size                     # LM head per row (the readout: O(V) more)
    base_f = cost.baseline_tokens * per_tok + cost.baseline_pairs * per_pair + reads * head
    grouped_f = cost.grouped_tokens * per_tok + cost.grouped_pairs * per_pair + rows * head
    res = {
        "workload": {k: getattr(args, k) for k in ("system", "thinking", "response", "turns")},
        "model": LLAMA, "threads": 1, "rounds": args.rounds, "sequences": len(seqs), "packed_tokens": batch.num_tokens,
        "scored_reads": reads, "distinct_rows": rows,
        "step_s": med, "step_s_all": times,
        "speedup_vs_alone": {k: med["alone"] / med[k] for k in ("before", "after")},
        "ideal_decoder_layers": ideal, "ideal_with_lm_head": base_f / grouped_f,
        "fraction_of_ideal_with_lm_head": {k: med["alone"] / med[k] * grouped_f / base_f for k in ("before", "after")},
        "readout_saved_bytes": held, "logit_bytes": logit_bytes,
        "readout_saved_over_logits": {k: held[k] / logit_bytes for k in held},
        "readout_s": readout_t,
        "after_vs_before_max_abs": {"logprobs": float((lp_of["after"] - lp_of["before"]).abs().max()),
                                    "logit_grad": float((grad_of["after"] - grad_of["before"]).abs().max())},
    }
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
        Path(args.out + ".md").write_text(table(res))
    return 0


def table(r: dict) -> str:
    mib = 2 ** 20
    wl = r["workload"]
    lines = [f"# Fully scored multi-turn tree: system {wl['system']}, thinking {wl['thinking']}, response "
             f"{wl['response']}, {wl['turns']} turns",
             "",
             f"{r['sequences']} trajectories, {r['packed_tokens']} packed tokens, {r['scored_reads']} scored reads of "
             f"{r['distinct_rows']} distinct logit rows; 2-layer Llama hidden 128 vocab 2048, float32, 1 thread, "
             f"median of {r['rounds']} interleaved rounds (`python benchmarks/readout_tree.py`).",
             "",
             "| readout | step s (fwd + lp + bwd) | speedup vs alone | ideal (layers + LM head) | of that ideal "
             "| ideal (layers only) | readout saved for backward | / logits' bytes | readout s (fwd + bwd) |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| alone (stock, each trajectory) | {r['step_s']['alone']:.2f} | 1.00x | | | | | | |"]
    for k in ("before", "after"):
        lines.append(f"| {k} | {r['step_s'][k]:.2f} | {r['speedup_vs_alone'][k]:.2f}x | {r['ideal_with_lm_head']:.2f}x | "
                     f"{r['fraction_of_ideal_with_lm_head'][k]:.2f} | {r['ideal_decoder_layers']:.2f}x | "
                     f"{r['readout_saved_bytes'][k] / mib:.1f} MiB | {r['readout_saved_over_logits'][k]:.2f} | "
                     f"{r['readout_s'][k]:.3f} |")
    d = r["after_vs_before_max_abs"]
    lines += ["", f"logits: {r['logit_bytes'] / mib:.1f} MiB. after vs before, max |diff|: log-probs {d['logprobs']:.2g}, "
              f"gradient of the logits {d['logit_grad']:.2g}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
