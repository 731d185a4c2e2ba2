"""P7: agentic tree rollouts -- baseline vs one-level prompt sharing vs the batch-wide prefix trie.

The batch (issue 10): one system prompt shared by 4 groups; per group a task prompt and G = 8
trajectories of 3 turns (assistant message, then a tool reply); the trajectories of a group are a
tree rollout: 2 different first assistant messages, each continued by 2 second messages that share
their first 16-48 tokens (a branch in the middle of a turn), each continued by 2 third messages
(a branch at a turn boundary, after the tool reply). Loss on assistant tokens only.

Contenders, each on a deep copy of one random-weight Llama, one forward+backward of an
advantage-weighted log-prob loss:

- ``baseline``: the stock model (sdpa), every sequence alone, right-padded, micro-batches of
  ``--micro`` rows of one group with a backward after each (gradient accumulation; a batch of all
  32 padded rows needs more memory than a 23 GiB machine has), logits for the rows after the prompt
  (``logits_to_keep``, as TRL does); activation memory is reported summed over the micro-batches
  (what one batch of all N rows would keep) and for the largest one;
- ``alone``: the stock model, one call per sequence, no padding (causal kernel, no padded pairs),
  backward after each call; memory reported the same way;
- ``one-level``: ``flexgroup.patch`` + ``GroupedBatch.from_groups`` with prompt = system + task prompt
  (what PrefixGrouper / unsloth / verl share), responses = the 3 turns;
- ``trie``: ``flexgroup.patch`` + ``GroupedBatch.from_sequences`` (everything shared is encoded once).

Each contender's log-probs are checked against the baseline on the loss mask before it is timed.
Reported: tokens, attention pairs, the ideal speedup from ``Layout.cost()``, medians of interleaved
rounds (wall and process CPU time), activation memory (bytes autograd saves for backward).

    flexgroup bench trees [--rounds 3] [--threads 1] [--out benchmarks/results/trees-1t.json]
"""

from __future__ import annotations

import argparse
import copy
import random
import sys

import torch

import flexgroup
from flexgroup import GroupedBatch
from .harness import build_model
from .measure import environment, finish_workload, interleaved_medians, saved_bytes
from ..models.zoo import ideal_speedup

MODEL = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=128)


def agentic_batch(seed: int = 0, groups: int = 4, system: tuple[int, int] = (1024, 2048), task=(256, 512),
                  assistant=(64, 128), tool=(128, 256), vocab: int = 128):
    """The P7 batch: ``(sequences, loss_masks, prompt_lens)``, trajectories group by group.

    Returns lists of N = 8 * groups LongTensors [n_i], BoolTensors [n_i] (True on assistant tokens)
    and the length of each sequence's system + task prompt.
    """
    rng = random.Random(seed)

    def toks(lo_hi):
        return [rng.randrange(1, vocab) for _ in range(rng.randint(*lo_hi))]

    sys_p = toks(system)
    seqs, masks, plens = [], [], []
    for _ in range(groups):
        prompt = sys_p + toks(task)
        for _a in range(2):                                 # turn 1: two different first messages
            t1 = toks(assistant)
            r1 = toks(tool)
            for _b in range(2):                             # turn 2: branch mid-message
                if _b == 0:
                    t2 = toks(assistant)
                    shared2 = rng.randint(min(16, len(t2) - 1), min(48, len(t2) - 1))
                else:
                    t2 = t2[:shared2] + toks((len(t2) - shared2, len(t2) - shared2))
                r2 = toks(tool)
                for _c in range(2):                         # turn 3: branch at the turn boundary
                    t3 = toks(assistant)
                    r3 = toks(tool)
                    parts = [(prompt, False), (t1, True), (r1, False), (t2, True), (r2, False), (t3, True),
                             (r3, False)]
                    seqs.append(torch.tensor([x for p, _ in parts for x in p]))
                    masks.append(torch.tensor([m for p, m in parts for _ in p]))
                    plens.append(len(prompt))
    return seqs, masks, plens


class _Contender:
    def __init__(self, model, weights: torch.Tensor):
        self.model, self.w = model, weights

    def step(self):
        self.model.zero_grad(set_to_none=True)
        self.forward_loss().backward()

    def forward_loss(self):
        return (self.logprobs() * self.w[:, None]).sum()

    def saved(self) -> dict:
        """Activation memory: bytes autograd saves for backward in one forward of the whole batch."""
        return dict(saved_bytes=saved_bytes(self.forward_loss, list(self.model.parameters())))


class Baseline(_Contender):
    """Every sequence alone, right-padded, stock sdpa, one micro-batch per group (gradient accumulation).

    Log-probs [N, L_max] on the loss mask; logits only for the rows after the micro-batch's prompt.
    """

    def __init__(self, model, seqs, masks, plens, weights, micro: list[range]):
        super().__init__(model, weights)
        self.width = max(len(s) for s in seqs)
        self.micro = []
        for rows in micro:
            n = max(len(seqs[i]) for i in rows)
            ids = torch.zeros(len(rows), n, dtype=torch.long)
            att = torch.zeros(len(rows), n, dtype=torch.long)
            mask = torch.zeros(len(rows), self.width, dtype=torch.bool)
            for k, i in enumerate(rows):
                ids[k, :len(seqs[i])], att[k, :len(seqs[i])], mask[k, :len(seqs[i])] = seqs[i], 1, masks[i]
            keep = n - min(plens[i] for i in rows) + 1  # rows from the last prompt position on
            self.micro.append((rows, ids, att, mask, keep))

    @property
    def padded_tokens(self) -> int:
        return sum(ids.numel() for _, ids, _, _, _ in self.micro)

    def _logprobs(self, ids, att, mask, keep):
        logits = self.model(input_ids=ids, attention_mask=att, use_cache=False,
                            logits_to_keep=keep).logits[:, :-1]                      # predicts the last keep-1 columns
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -keep + 1:, None])[..., 0]
        out = torch.zeros(mask.shape, dtype=lp.dtype)
        out[:, ids.shape[1] - keep + 1: ids.shape[1]] = lp
        return out * mask

    def logprobs(self):
        return torch.cat([self._logprobs(*m[1:]) for m in self.micro])

    def saved(self) -> dict:
        """Summed over the micro-batches (what one batch of all rows keeps), and the largest one."""
        per = [saved_bytes(lambda m=m: self._logprobs(*m[1:]).sum(), list(self.model.parameters())) for m in self.micro]
        return dict(saved_bytes=sum(per), saved_bytes_micro_max=max(per))

    def step(self):  # backward per micro-batch, as a trainer accumulating gradients does
        self.model.zero_grad(set_to_none=True)
        for rows, *m in self.micro:
            (self._logprobs(*m) * self.w[rows.start:rows.stop, None]).sum().backward()


class Alone(_Contender):
    """One stock call per sequence (no padding: the causal kernel, no padded pairs), backward after each."""

    def __init__(self, model, seqs, masks, weights):
        super().__init__(model, weights)
        self.seqs, self.masks = seqs, masks
        self.width = max(len(s) for s in seqs)

    def _logprobs(self, s, m):
        first = int(torch.nonzero(m)[0])  # logits from the row before the first scored token on
        logits = self.model(input_ids=s[None], use_cache=False, logits_to_keep=len(s) - first + 1).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, s[first:, None])[:, 0] * m[first:]
        return torch.nn.functional.pad(lp, (first, self.width - len(s)))

    def logprobs(self):
        return torch.stack([self._logprobs(s, m) for s, m in zip(self.seqs, self.masks)])

    def saved(self) -> dict:
        """Summed over the calls (what keeping every graph until one backward would cost), and the largest."""
        params = list(self.model.parameters())
        per = [saved_bytes(lambda s=s, m=m: self._logprobs(s, m).sum(), params) for s, m in zip(self.seqs, self.masks)]
        return dict(saved_bytes=sum(per), saved_bytes_micro_max=max(per))

    def step(self):
        self.model.zero_grad(set_to_none=True)
        for s, m, w in zip(self.seqs, self.masks, self.w):
            (self._logprobs(s, m) * w).sum().backward()


class Grouped(_Contender):
    """A patched model and a GroupedBatch; log-probs mapped to full-sequence columns [N, L_max]."""

    def __init__(self, model, batch: GroupedBatch, masks, plens, weights, shift: bool):
        super().__init__(model, weights)
        self.batch, self.inputs = batch, batch.model_inputs(needed_logits_only=True)
        self.width = max(len(m) for m in masks)
        self.cols = torch.stack([torch.nn.functional.pad(m, (0, self.width - len(m))) for m in masks])
        self.shift = plens if shift else None  # from_groups: column 0 = first response token

    def logprobs(self):
        lp = self.batch.logprobs(self.model(**self.inputs).logits)
        if self.shift is not None:
            lp = torch.stack([torch.nn.functional.pad(row, (p, self.width - p - row.numel()))[: self.width]
                              for row, p in zip(lp, self.shift)])
        return lp * self.cols


def main(argv=None) -> int:
    """``flexgroup bench trees ...`` (the options: :func:`flexgroup.bench.options.parser`)."""
    from .options import parser

    return run(parser("trees").parse_args(argv))


def check_and_time(contenders: dict, rec: dict, rounds: int, atol: float) -> None:
    """Check each contender's log-probs against the first contender's (AssertionError beyond ``atol``), record
    its ``saved()`` bytes, time every ``step`` in interleaved rounds (one untimed), and record into
    ``rec["results"][name]``: ``max_abs_err``, the saved bytes, ``median_s`` / ``times_s`` / ``median_cpu_s``,
    and ``speedup`` / ``speedup_cpu`` over the first contender."""
    first, ref = next(iter(contenders)), None
    for name, c in contenders.items():
        with torch.no_grad():
            lp = c.logprobs()
        ref = lp if ref is None else ref
        err = (lp - ref).abs().max().item()
        if not err <= atol:
            raise AssertionError(f"{name}: log-probs differ from {first}'s by {err:.3g} > {atol}")
        rec["results"][name] = dict(max_abs_err=err, **c.saved())
        print(f"{name:>10}: checked (max |dlogp| {err:.2e}), saved for backward {rec['results'][name]['saved_bytes'] / 2**20:.0f} MiB",
              file=sys.stderr)
    for n, times in interleaved_medians({n: c.step for n, c in contenders.items()}, repeats=rounds).items():
        rec["results"][n].update(times)
    base = rec["results"][first]
    for r in rec["results"].values():
        r["speedup"] = base["median_s"] / r["median_s"]
        r["speedup_cpu"] = base["median_cpu_s"] / r["median_cpu_s"]


def run(args: argparse.Namespace) -> int:
    """Run the workload with parsed ``args``; returns the exit status."""
    torch.set_num_threads(args.threads)

    lengths = {}
    if args.quick:
        lengths = dict(system=(128, 256), task=(32, 64), assistant=(8, 16), tool=(16, 32))
    seqs, masks, plens = agentic_batch(args.seed, vocab=MODEL["vocab"], **lengths)
    model = build_model(MODEL)
    w = torch.linspace(-1.0, 1.0, len(seqs))
    trie = GroupedBatch.from_sequences(seqs, masks)
    starts = [0] + [i for i in range(1, len(seqs)) if not torch.equal(seqs[i][: plens[i]], seqs[i - 1][: plens[i - 1]])]
    bounds = starts + [len(seqs)]
    prompts = [seqs[a][: plens[a]] for a in starts]
    one = GroupedBatch.from_groups(prompts, [[seqs[i][plens[i]:] for i in range(a, b)] for a, b in zip(bounds, bounds[1:])])
    patched = flexgroup.patch(copy.deepcopy(model))
    contenders = {
        "baseline": Baseline(copy.deepcopy(model), seqs, masks, plens, w,
                             [range(i, min(i + args.micro, b)) for a, b in zip(bounds, bounds[1:])
                              for i in range(a, b, args.micro)]),
        "alone": Alone(copy.deepcopy(model), seqs, masks, w),
        "one-level": Grouped(patched, one, masks, plens, w, shift=True),
        "trie": Grouped(patched, trie, masks, plens, w, shift=False),
    }
    for b in filter(None, args.backends.split(",")):
        contenders[f"trie-{b}"] = Grouped(flexgroup.patch(copy.deepcopy(model), backend=b), trie, masks, plens, w,
                                          shift=False)
    batches = {"one-level": one, "trie": trie}
    layouts = {k: b.layout for k, b in batches.items()}
    base_cost = trie.cost()
    rec = dict(model=MODEL, environment=environment(), sequences=len(seqs), rounds=args.rounds,
               tokens=dict(baseline=base_cost.baseline_tokens, padded=contenders["baseline"].padded_tokens,
                           **{k: lay.num_tokens for k, lay in layouts.items()}),
               pairs=dict(baseline=base_cost.baseline_pairs, **{k: lay.cost().grouped_pairs for k, lay in layouts.items()}),
               segments=dict(trie=trie.layout.num_segments, **{"one-level": one.layout.num_segments}),
               ideal={k: ideal_speedup(model.config, b.layout, b.sequence_ends) for k, b in batches.items()},
               results={})
    assert one.cost().baseline_tokens == base_cost.baseline_tokens  # the same sequences
    check_and_time(contenders, rec, args.rounds, args.atol)   # the baseline first: it is the reference
    return finish_workload(rec, table(rec), args.out)


def table(rec: dict) -> str:
    """Markdown table of one run."""
    res, ideal = rec["results"], rec["ideal"]
    t = rec["tokens"]
    trie_vs_one = res["one-level"]["median_s"] / res["trie"]["median_s"]
    lines = [
        f"{rec['sequences']} sequences; tokens: baseline {t['baseline']:,} ({t['padded']:,} padded), one-level "
        f"{t['one-level']:,}, trie {t['trie']:,}; pairs: baseline {rec['pairs']['baseline']:,}, one-level "
        f"{rec['pairs']['one-level']:,}, trie {rec['pairs']['trie']:,}; trie segments {rec['segments']['trie']}",
        "",
        "| contender | median s (wall) | median s (CPU) | speedup wall | speedup CPU | ideal | wall / ideal | "
        "over `alone` / ideal | saved for backward | max abs err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, r in res.items():
        i = ideal.get(n)
        ideal_s = f"{i:.2f}x" if i else ("1 (ref.)" if n == "baseline" else "")
        of_ideal = f"{r['speedup'] / i:.2f}" if i else ""
        of_alone = f"{res['alone']['median_s'] / r['median_s'] / i:.2f}" if i else ""
        mem = f"{r['saved_bytes'] / 2**20:.0f} MiB"
        if "saved_bytes_micro_max" in r:
            mem += f" (largest call {r['saved_bytes_micro_max'] / 2**20:.0f})"
        lines.append(f"| {n} | {r['median_s']:.2f} | {r['median_cpu_s']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['speedup_cpu']:.2f}x | {ideal_s} | {of_ideal} | {of_alone} | {mem} | "
                     f"{r['max_abs_err']:.1e} |")
    lines += ["", f"trie vs one-level: {trie_vs_one:.2f}x measured (wall), ideal "
              f"{ideal['trie'] / ideal['one-level']:.2f}x"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
