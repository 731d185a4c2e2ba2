"""How far each attention backend's grouped run is from a float64 truth, beside the stock float32 run.

    python benchmarks/lse_precision.py --model DIR [--out benchmarks/results/lse-precision-qwen.json]

The batch is ``flexgroup verify``'s default (two groups of a 24-token prompt and responses of 5, 12,
1 and 9 tokens, ids drawn over the whole vocabulary, seed 0) and its loss. One process, memory-lean
(the truth's gradients kept as float32 sums, then its float64 copy freed; one grouped gradient set at
a time): the float64 truth (a float64 copy under :func:`flexgroup.reference.layerwise.float64_scope`), the stock
float32 run (each sequence alone), then grouped runs with backend ``lse`` (keys centred, the fix of
issue 31), ``lse`` with ``CENTRE_KEYS`` off (the backend before it) and ``sdpa``. Reported for each:
max |logits diff| and max |log-prob diff| (read tokens) and the max over parameters of the relative
gradient difference, against the truth and against the stock run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    import flexgroup
    from flexgroup import GroupedBatch
    from flexgroup.bench.measure import write_json
    from flexgroup.verification.calibration import Float64Reference, sequence_backward
    from flexgroup.verification.equivalence import _advantages, _grads, _param_errors, _stock_copy
    from flexgroup.kernels import lse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--vocab-limit", type=int, help="draw ids below this (default: the whole vocabulary)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).float().eval()
    vocab = args.vocab_limit or model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    shape = [(24, [5, 12, 1, 9])] * 2
    prompts = [torch.randint(0, vocab, (p,), generator=gen) for p, _ in shape]
    responses = [[torch.randint(0, vocab, (n,), generator=gen) for n in lens] for _, lens in shape]
    batch = GroupedBatch.from_groups(prompts, responses)
    n, mask = batch.num_responses, batch.response_mask
    adv = _advantages(n, 0, torch.float64, "cpu")

    def each_alone(run):
        logits, lps = [], torch.zeros(mask.shape, dtype=torch.float64)
        for i, path in enumerate(batch.paths):
            r = batch.response_lengths[i]
            lg, lp = run(batch.input_ids[path], r, mask[i, :r], -adv[i] / n)
            logits.append(lg.double())
            lps[i, :r] = lp.double()
        return logits, lps

    base, impl = _stock_copy(model, None, torch.float32)
    truth = Float64Reference("float64", base, lambda: _stock_copy(model, impl, torch.float64)[0])
    t_logits, t_lp = each_alone(truth.run)
    truth.release()
    t_grads = truth.grads()
    s_logits, s_lp = each_alone(lambda *a: sequence_backward(base, *a))
    s_grads = _grads(base)

    def compare(logits, lp, grads, ref_logits, ref_lp, ref_grads) -> dict:
        errs = _param_errors(grads, ref_grads)[0]
        worst = max(errs, key=lambda k: errs[k][1])
        return dict(logits=max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)),
                    logprobs=float(torch.where(mask, (lp - ref_lp).abs(), 0).max()),
                    grads=errs[worst][1], worst=worst)

    rows = {"stock float32 (each alone)": dict(vs_truth=compare(s_logits, s_lp, s_grads, t_logits, t_lp, t_grads))}
    for name, backend, centre in (("lse (keys centred)", "lse", True), ("lse before (raw keys)", "lse", False),
                                  ("sdpa", "sdpa", True)):
        lse.CENTRE_KEYS = centre
        grouped, _ = _stock_copy(model, impl, torch.float32)
        flexgroup.patch(grouped, backend=backend)
        out = grouped(**batch.model_inputs("cpu")).logits
        lp = batch.logprobs(out)
        (-(adv.float()[:, None] * torch.where(mask, lp, 0)).sum() / n).backward()
        g_logits = [out.detach()[0][p].double() for p in batch.paths]
        g_lp = torch.where(mask, lp.detach().double(), 0)
        g_grads = _grads(grouped)
        rows[name] = dict(vs_truth=compare(g_logits, g_lp, g_grads, t_logits, t_lp, t_grads),
                          vs_stock=compare(g_logits, g_lp, g_grads, s_logits, s_lp, s_grads))
        del grouped, out, lp, g_grads
        lse.CENTRE_KEYS = True
    print(f"{args.model}: verify's default batch, ids below {vocab}")
    print("| run | vs | logits | log-probs | grads (rel) | worst parameter |\n|---|---|---|---|---|---|")
    for name, r in rows.items():
        for vs, e in r.items():
            print(f"| {name} | {vs.replace('vs_', '')} | {e['logits']:.2e} | {e['logprobs']:.2e} | {e['grads']:.2e} | "
                  f"{e['worst']} |")
    if args.out:
        write_json(dict(model=args.model, vocab=vocab, rows=rows), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
