"""P11: a fully scored multi-turn tree (AReaL-DTA's shape at CPU scale) -- each trajectory alone vs the trie.

The batch (issue 39): one trajectory per turn, turn k's is ``system + response_1 .. response_{k-1} + thinking_k +
response_k`` (earlier turns' thinking is dropped from the history, as reasoning agents do), every token but the
first scored: a shared turn's tokens are read once per trajectory that contains it. The default sizes are a
quarter of AReaL-DTA's (system 250, thinking 125, response 50 tokens; 17 turns); a 2-layer Llama (hidden 128,
MLP 512, 4 / 2 heads, vocab 2048), float32.

Contenders, one forward + backward of a weighted log-prob loss each (log-probs checked against ``alone`` first):

- ``alone``: the stock model (sdpa), one call per trajectory, backward after each;
- ``trie``: ``flexgroup.patch`` + ``GroupedBatch.from_sequences``, logits for the distinct rows only
  (``needed_logits_only``), ``batch.logprobs`` (the shared readout: each distinct row once).

Reported: medians of interleaved rounds (wall and process CPU time), the ideal (FLOPs of the decoder layers
and the LM head, whose rows are every scored token for ``alone`` and each distinct row for the trie; the
decoder layers alone beside), and the bytes the readout saves for backward against the logits' bytes.

    flexgroup bench dta [--rounds 3] [--threads 1] [--quick] [--out benchmarks/results/dta-1t.json]
"""

from __future__ import annotations

import argparse
import copy

import torch

import flexgroup
from flexgroup import GroupedBatch
from .harness import build_model
from .measure import environment, finish_workload, saved_bytes
from .trees import Alone, Grouped, check_and_time
from ..models.zoo import flops_per_token_and_pair, ideal_speedup

MODEL = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=2048)
SIZES = dict(system=250, thinking=125, response=50, turns=17)
QUICK = dict(system=32, thinking=16, response=8, turns=5)


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


class Workload:
    """The batch, the stock model and a patched copy, the loss weights, and the two contenders."""

    def __init__(self, sizes: dict, seed: int = 0):
        self.seqs = dta_tree(**sizes, vocab=MODEL["vocab"], seed=seed)
        self.masks = [torch.arange(s.numel()) > 0 for s in self.seqs]      # every token but the first
        self.batch = GroupedBatch.from_sequences(self.seqs)
        self.stock = build_model(MODEL)
        self.patched = flexgroup.patch(copy.deepcopy(self.stock))
        self.w = torch.linspace(-1.0, 1.0, len(self.seqs))
        self.contenders = {"alone": Alone(self.stock, self.seqs, self.masks, self.w),
                           "trie": Grouped(self.patched, self.batch, self.masks, None, self.w, shift=False)}

    def ideals(self) -> dict:
        """``with_lm_head`` (the LM head on every scored row alone, each distinct row once grouped) and
        ``decoder_layers`` (``flexgroup.models.zoo.ideal_speedup``)."""
        cfg, b = self.patched.config, self.batch
        cost = b.layout.cost(b.sequence_ends)
        per_tok, per_pair = flops_per_token_and_pair(cfg)
        head = 2 * cfg.hidden_size * cfg.vocab_size
        alone = cost.baseline_tokens * per_tok + cost.baseline_pairs * per_pair + int(b.response_mask.sum()) * head
        grouped = cost.grouped_tokens * per_tok + cost.grouped_pairs * per_pair + b.logit_rows.numel() * head
        return dict(with_lm_head=alone / grouped, decoder_layers=ideal_speedup(cfg, b.layout, b.sequence_ends))

    def readout_bytes(self, read=None) -> tuple[int, int]:
        """(bytes ``read(logits)`` saves for backward, the logits' bytes) on the trie's logits [1, K, V];
        ``read`` defaults to ``batch.logprobs``."""
        with torch.no_grad():
            logits = self.patched(**self.batch.model_inputs(needed_logits_only=True)).logits
        logits.requires_grad_()
        return saved_bytes(lambda: (read or self.batch.logprobs)(logits)), logits.numel() * logits.element_size()


def run(args: argparse.Namespace) -> int:
    """Run the workload with parsed ``args``; returns the exit status."""
    torch.set_num_threads(args.threads)
    sizes = {k: getattr(args, k) or (QUICK if args.quick else SIZES)[k] for k in SIZES}
    wl = Workload(sizes, args.seed)
    b = wl.batch
    held, logit_bytes = wl.readout_bytes()
    ideals = wl.ideals()
    rec = dict(model=MODEL, environment=environment(), workload=sizes, sequences=len(wl.seqs), rounds=args.rounds,
               tokens=dict(alone=sum(s.numel() for s in wl.seqs), trie=b.num_tokens),
               scored_reads=int(b.response_mask.sum()), distinct_rows=b.logit_rows.numel(),
               ideal={"trie": ideals["with_lm_head"]}, ideal_decoder_layers={"trie": ideals["decoder_layers"]},
               readout=dict(saved_bytes=held, logit_bytes=logit_bytes, saved_over_logits=held / logit_bytes),
               results={})
    check_and_time(wl.contenders, rec, args.rounds, args.atol)   # alone first: the reference
    return finish_workload(rec, table(rec), args.out)


def table(rec: dict) -> str:
    """Markdown table of one run."""
    s, r, ro = rec["workload"], rec["results"]["trie"], rec["readout"]
    ideal, layers = rec["ideal"]["trie"], rec["ideal_decoder_layers"]["trie"]
    mib = 2 ** 20
    return "\n".join([
        f"{rec['sequences']} trajectories (system {s['system']}, thinking {s['thinking']}, response {s['response']}, "
        f"{s['turns']} turns); tokens: alone {rec['tokens']['alone']:,}, trie {rec['tokens']['trie']:,}; "
        f"{rec['scored_reads']:,} scored reads of {rec['distinct_rows']:,} distinct logit rows",
        "",
        "| contender | median s (wall) | median s (CPU) | speedup wall | speedup CPU | ideal (+ LM head) | CPU / ideal "
        "| ideal (layers) | saved for backward | max abs err |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {n} | {x['median_s']:.3f} | {x['median_cpu_s']:.3f} | {x['speedup']:.2f}x | {x['speedup_cpu']:.2f}x | "
          + (f"{ideal:.2f}x | {x['speedup_cpu'] / ideal:.2f} | {layers:.2f}x" if n == "trie" else " | | ")
          + f" | {x['saved_bytes'] / mib:.1f} MiB | {x['max_abs_err']:.2g} |" for n, x in rec["results"].items()),
        "",
        f"readout (trie): {ro['saved_bytes'] / mib:.1f} MiB saved for backward, {ro['saved_over_logits']:.2f}x the "
        f"logits' {ro['logit_bytes'] / mib:.1f} MiB; trie {r['speedup_cpu'] / ideal:.2f} of the ideal (CPU time)",
    ])


def main(argv=None) -> int:
    """``flexgroup bench dta ...`` (the options: :func:`flexgroup.bench.options.parser`)."""
    from .options import parser

    return run(parser("dta").parse_args(argv))
