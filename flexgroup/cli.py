"""The ``flexgroup`` command: ``demo``, ``verify`` and ``bench``.

``flexgroup demo`` runs one GRPO training step (or ``--steps`` optimizer steps) twice on a built-in
model with random weights -- the repeated-prefix baseline (a right-padded batch of the G sequences
``[P; R_i]`` through the stock model, as trainers run it) and the grouped row through flexgroup --
and prints work, time, memory, loss and the differences. ``flexgroup verify`` runs
:func:`flexgroup.verify.verify` on a built-in or local model. ``flexgroup bench`` is provided by
:mod:`flexgroup.bench` (imported on use).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import sys
import time
from typing import Sequence

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKENDS = ("auto", "sdpa", "flex", "flex_eager")


# ---------------------------------------------------------------------------- argument types
def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def int_list(text: str) -> list[int]:
    """``"5,12,1"`` -> ``[5, 12, 1]`` (positive integers)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers like 5,12,3, got {text!r}")
    return [positive_int(p) for p in parts]


def group_layout(text: str) -> list[tuple[int, list[int]]]:
    """``"24:5,12,1;6:3,3"`` -> ``[(24, [5, 12, 1]), (6, [3, 3])]``: groups as PREFIX:RESPONSE_LENS."""
    groups = []
    for part in (p.strip() for p in text.split(";")):
        prefix, sep, rest = part.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(
                f"expected groups like 24:5,12,1;6:3,3 (prefix length : response lengths), got {part!r}")
        groups.append((positive_int(prefix.strip()), int_list(rest)))
    return groups


def build_parser() -> argparse.ArgumentParser:
    from .models import ARCHS

    parser = argparse.ArgumentParser(
        prog="flexgroup",
        description="Shared-prefix (grouped) forward for GRPO-style training, exact against the baseline.")
    sub = parser.add_subparsers(dest="command", metavar="{demo,verify,bench}", required=True)

    def common(p: argparse.ArgumentParser, dtype: str) -> None:
        p.add_argument("--dtype", choices=DTYPES, default=dtype, help=f"parameter dtype (default {dtype})")
        p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="device (default cpu); on cuda the 'auto' backend is compiled flex attention")
        p.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="flexgroup attention backend (default auto: flex on cuda, exact sdpa on cpu)")
        p.add_argument("--seed", type=int, default=0, help="seed of weights and tokens (default 0)")

    demo = sub.add_parser("demo", help="one GRPO step, baseline vs grouped: same gradients, less work",
                          description="Run one GRPO training step twice on a built-in model with random weights "
                          "(repeated-prefix baseline through the stock model, and grouped through flexgroup) and "
                          "compare work, time, memory, loss, log-probs and gradients.")
    demo.add_argument("--arch", choices=ARCHS, default="llama", help="architecture (default llama)")
    demo.add_argument("--size", choices=("demo", "tiny"), default="demo",
                      help="model size preset (default demo: hidden 256, 4 layers)")
    demo.add_argument("--prefix-len", type=positive_int, default=1024, help="prompt tokens P (default 1024)")
    demo.add_argument("--group-size", type=positive_int, default=8, help="responses per prompt G (default 8)")
    demo.add_argument("--response-len", type=positive_int, default=128,
                      help="longest response; the G lengths spread evenly from about half of it (default 128)")
    demo.add_argument("--groups", type=positive_int, default=1, help="prompts (groups) in the batch (default 1)")
    demo.add_argument("--steps", type=positive_int, default=1,
                      help="optimizer steps (AdamW) on both runs, with a progress bar of both losses (default 1)")
    demo.add_argument("--lr", type=nonnegative_float, default=1e-4,
                      help="AdamW learning rate for --steps (default 1e-4)")
    demo.add_argument("--aggregation", choices=("token-mean", "sequence-mean", "fixed"), default="token-mean",
                      help="loss aggregation (default token-mean, DAPO)")
    demo.add_argument("--threads", type=positive_int, help="CPU threads for torch (default: torch's choice)")
    demo.add_argument("--beta", type=nonnegative_float, default=0.04, help="KL coefficient (default 0.04)")
    common(demo, "float32")

    ver = sub.add_parser("verify", help="check grouped == repeated-prefix baseline on a model",
                         description="Run flexgroup.verify: grouped forward/backward of a patched copy versus each "
                         "[P; R_i] alone through an unpatched copy; exit status 1 beyond tolerance.")
    src = ver.add_mutually_exclusive_group(required=True)
    src.add_argument("--arch", choices=ARCHS, help="a tiny built-in config of this architecture")
    src.add_argument("--model", metavar="PATH", help="a local Hugging Face model directory (never downloads)")
    ver.add_argument("--prefix-len", type=positive_int, default=24, help="prompt tokens per group (default 24)")
    ver.add_argument("--response-lens", type=int_list, default=[5, 12, 1, 9], metavar="N,N,...",
                     help="response lengths of each group (default 5,12,1,9)")
    ver.add_argument("--groups", type=positive_int, default=2, help="groups packed in the row (default 2)")
    ver.add_argument("--layout", type=group_layout, metavar="P:R,R;P:R,...",
                     help="groups of different shapes, e.g. 24:5,12,1;6:3,3 (replaces the three options above)")
    ver.add_argument("--tol-logits", type=nonnegative_float, help="max |diff| of logits (default by dtype)")
    ver.add_argument("--tol-logprobs", type=nonnegative_float, help="max |diff| of log-probs (default by dtype)")
    ver.add_argument("--tol-grads", type=nonnegative_float, help="max relative gradient diff (default by dtype)")
    common(ver, "float32")

    sub.add_parser("bench", add_help=False, help="benchmarks (flexgroup bench --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flexgroup`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: CUDA is not available in this PyTorch build ({torch.__version__}); "
                     "use --device cpu")
    if args.device == "cpu" and args.backend in ("flex", "flex_eager"):
        parser.error(f"--backend {args.backend} cannot train on cpu: FlexAttention has no CPU backward; "
                     "use --backend sdpa or auto (exact) on cpu")
    return run_demo(args) if args.command == "demo" else _verify(args)


def _bench(argv: list[str]) -> int:
    try:
        bench = importlib.import_module("flexgroup.bench")
    except ModuleNotFoundError as e:
        if e.name not in ("flexgroup.bench",):
            raise
        print("flexgroup bench: not available in this installation (module flexgroup.bench is missing); "
              "run the benchmarks in benchmarks/ with pytest instead", file=sys.stderr)
        return 2
    return int(bench.main(argv) or 0)

# ---------------------------------------------------------------------------- demo
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _Run:
    """One side of the demo: a model, how it turns the batch into [N, Rmax] log-probs, its record."""

    def __init__(self, name: str, model, logp_fn, device: str):
        self.name, self.model, self.logp_fn, self.device = name, model, logp_fn, device
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # process CPU time (all threads): robust on a shared machine
        self.losses: list[float] = []
        self.peak: int | None = None
        self.old = None  # [N, Rmax] log-probs of the sampling policy (step 0), also the KL reference

    def step(self, adv, mask, args, record: bool = True) -> torch.Tensor:
        from .grpo import policy_loss

        self.model.zero_grad(set_to_none=True)
        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            start_mem = torch.cuda.memory_allocated()
        _sync(self.device)
        t0, c0 = time.perf_counter(), time.process_time()
        logp = self.logp_fn()
        old = self.old if self.old is not None else logp.detach()
        loss = policy_loss(logp, old, adv, mask, aggregation=args.aggregation, max_len=mask.shape[1],
                           ref_logp=old, beta=args.beta)
        loss.backward()
        _sync(self.device)
        if record:
            self.times.append(time.perf_counter() - t0)
            self.cpu_times.append(time.process_time() - c0)
            self.losses.append(loss.item())
            if cuda:
                self.peak = max(self.peak or 0, torch.cuda.max_memory_allocated() - start_mem)
            if self.old is None:
                self.old = logp.detach()
        return logp.detach()


def _demo_inputs(args, vocab: int, P: int, R: int, gen: torch.Generator):
    """Prompts, responses (lengths R/2..R), rewards and the baseline's right-padded tensors."""
    G = args.group_size
    lens = [max(1, -(-R * (G + i + 1) // (2 * G))) for i in range(G)]  # ceil(R (G+i+1) / 2G): ~R/2 .. R
    prompts = [torch.randint(3, vocab, (P,), generator=gen) for _ in range(args.groups)]
    responses = [[torch.randint(3, vocab, (n,), generator=gen) for n in lens] for _ in prompts]
    seqs = [(p, r) for p, rs in zip(prompts, responses) for r in rs]
    N, Rmax = len(seqs), max(lens)
    ids = torch.zeros(N, P + Rmax, dtype=torch.long)   # pad id 0, right padding
    attn = torch.zeros(N, P + Rmax, dtype=torch.long)
    for i, (p, r) in enumerate(seqs):
        ids[i, :P], ids[i, P:P + r.numel()], attn[i, :P + r.numel()] = p, r, 1
    # toy reward: the share of even token ids in the response (a verifiable "task")
    rewards = torch.tensor([float((r % 2 == 0).float().mean()) for _, r in seqs])
    return prompts, responses, ids, attn, rewards, lens


def _build_runs(args, P: int, R: int, base_model, grouped_model, gen, dtype):
    from . import GroupedBatch
    from .grpo import group_advantages

    vocab = base_model.config.get_text_config().vocab_size
    prompts, responses, ids, attn, rewards, lens = _demo_inputs(args, vocab, P, R, gen)
    dev = args.device
    batch = GroupedBatch.from_groups(prompts, responses)
    ids, attn = ids.to(dev), attn.to(dev)
    Rmax = max(lens)
    comp = ids[:, P:]

    def baseline_logp():  # what trainers do: padded batch, logits only for the completion (TRL)
        logits = base_model(input_ids=ids, attention_mask=attn, logits_to_keep=Rmax + 1, use_cache=False).logits
        logits = logits[:, :-1] if logits.dtype in (torch.float32, torch.float64) else logits[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(2, comp[..., None])[..., 0]  # [N, Rmax]

    inputs = batch.model_inputs(dev, needed_logits_only=True)  # LM head on the rows log-probs read

    def grouped_logp():
        return batch.logprobs(grouped_model(**inputs).logits)  # [N, Rmax]

    mask = batch.response_mask.to(dev)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    adv = group_advantages(rewards, group_size=args.group_size).to(dev, work)
    runs = (_Run("baseline", base_model, baseline_logp, dev), _Run("flexgroup", grouped_model, grouped_logp, dev))
    return runs, batch, adv, mask, lens


def _progress(step: int, total: int, runs, width: int = 24) -> None:
    done = int(width * step / total)
    b, g = runs[0].losses[-1], runs[1].losses[-1]
    line = (f"step {step:>3}/{total} [{'#' * done}{'.' * (width - done)}] loss baseline {b:+.6f}  "
            f"flexgroup {g:+.6f}  |diff| {abs(b - g):.1e}")
    end = "\r" if sys.stdout.isatty() and step < total else "\n"
    print(line, end=end, flush=True)


def run_demo(args) -> int:
    """``flexgroup demo``; returns 0 when the two runs are equivalent, 1 otherwise."""
    import flexgroup

    from .models import build_model, flops_per_token_and_pair
    from .equivalence import default_tolerances, grad_difference

    dtype, dev = DTYPES[args.dtype], args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    base_model = build_model(args.arch, dtype=dtype, seed=args.seed, size=args.size).to(dev)
    grouped_model = flexgroup.patch(copy.deepcopy(base_model), backend=args.backend)
    cfg = base_model.config.get_text_config()
    gen = torch.Generator().manual_seed(args.seed + 1)
    P, R = args.prefix_len, args.response_len

    # Warm-up: first-call costs (allocator, thread pool, torch.compile on cuda) stay out of the timing.
    # On CPU a small problem through the same code suffices; compiled kernels need the real shapes.
    wP, wR = (P, R) if dev == "cuda" else (min(P, 32), min(R, 8))
    wruns, _, wadv, wmask, _ = _build_runs(args, wP, wR, base_model, grouped_model, gen, dtype)
    for run in wruns:
        run.step(wadv, wmask, args, record=False)

    runs, batch, adv, mask, lens = _build_runs(args, P, R, base_model, grouped_model, gen, dtype)
    base, grp = runs
    lp_b = base.step(adv, mask, args)
    lp_g = grp.step(adv, mask, args)
    d_lp = float(torch.where(mask, (lp_b.double() - lp_g.double()).abs(), 0).max())
    mlp_b, mlp_g = (float(torch.where(mask, lp.double(), 0).sum() / mask.sum()) for lp in (lp_b, lp_g))
    g_abs, g_rel, g_name, _ = grad_difference(grouped_model, base_model)
    if args.steps > 1:
        opts = [torch.optim.AdamW(r.model.parameters(), lr=args.lr) for r in runs]
        _progress(1, args.steps, runs)
        for s in range(2, args.steps + 1):
            for run, opt in zip(runs, opts):
                opt.step()
                run.step(adv, mask, args)
            _progress(s, args.steps, runs)

    tol = default_tolerances(dtype)
    ok = d_lp <= tol["logprobs"] and g_rel <= tol["grads"]
    cost = batch.layout.cost()
    ideal = cost.ideal_speedup(*flops_per_token_and_pair(cfg))
    tb, tg = statistics.median(base.times), statistics.median(grp.times)
    cb, cg = statistics.median(base.cpu_times), statistics.median(grp.cpu_times)
    padded = args.groups * args.group_size * (P + max(lens)) - cost.baseline_tokens
    hkv = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)

    print(f"flexgroup demo: {args.arch} (hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, "
          f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads / {hkv} KV, vocab {cfg.vocab_size}; "
          f"random weights), {args.dtype}, {dev}"
          + (f", {torch.get_num_threads()} threads" if dev == "cpu" else ""))
    print(f"{args.groups} group(s): prompt {P} tokens, {args.group_size} responses of {min(lens)}..{max(lens)} "
          f"tokens; toy reward = share of even token ids")
    print(f"loss: clipped policy gradient ({args.aggregation}) + {args.beta} x KL(k3) to the step-1 policy; "
          "step 1 is on-policy (ratio 1), later steps reuse its samples")
    print(f"baseline: padded batch of {len(lens) * args.groups} sequences [P; R_i] through the stock model "
          f"({base_model.config._attn_implementation}); flexgroup: one packed row, backend {args.backend!r}")
    mem = ("n/a (cpu)", "n/a (cpu)", "") if dev == "cpu" else (
        f"{base.peak / 2**20:,.1f} MiB", f"{grp.peak / 2**20:,.1f} MiB", f"{base.peak / max(grp.peak, 1):.2f}x")
    rows = [
        ("tokens processed", f"{cost.baseline_tokens:,} (+{padded:,} pad)", f"{cost.grouped_tokens:,}",
         f"{cost.baseline_tokens / cost.grouped_tokens:.2f}x"),
        ("attention pairs", f"{cost.baseline_pairs:,}", f"{cost.grouped_pairs:,}",
         f"{cost.baseline_pairs / cost.grouped_pairs:.2f}x"),
        (f"time / step{' (median)' if args.steps > 1 else ''}", f"{tb:.3f} s", f"{tg:.3f} s", f"{tb / tg:.2f}x"),
        *([("cpu time / step", f"{cb:.3f} s", f"{cg:.3f} s", f"{cb / cg:.2f}x")] if dev == "cpu" else []),
        ("peak memory (step)", *mem),
        ("mean log-prob", f"{mlp_b:+.8f}", f"{mlp_g:+.8f}", f"|diff| {abs(mlp_b - mlp_g):.1e}"),
        ("loss (step 1)", f"{base.losses[0]:+.8f}", f"{grp.losses[0]:+.8f}",
         f"|diff| {abs(base.losses[0] - grp.losses[0]):.1e}"),
    ]
    if args.steps > 1:
        rows.append((f"loss (step {args.steps})", f"{base.losses[-1]:+.8f}", f"{grp.losses[-1]:+.8f}",
                     f"|diff| {abs(base.losses[-1] - grp.losses[-1]):.1e}"))
    rows += [("max |d log-prob|", "", f"{d_lp:.2e}", f"tol {tol['logprobs']:.0e}"),
             ("max rel |d grad|", "", f"{g_rel:.2e}", f"tol {tol['grads']:.0e}  ({g_name})")]
    print()
    print(f"{'':<22}{'baseline':>24}{'flexgroup':>16}   baseline / flexgroup")
    for name, a, b, c in rows:
        print(f"{name:<22}{a:>24}{b:>16}   {c}")
    print()
    print(f"equivalent: {'yes' if ok else 'no'} (max |dlogp| = {d_lp:.1e}, max rel |dgrad| = {g_rel:.1e}); "
          f"speedup: {tb / tg:.2f}x (ideal {ideal:.2f}x)")
    print(f"(total {time.perf_counter() - t_start:.1f} s)", file=sys.stderr)
    return 0 if ok else 1


# ---------------------------------------------------------------------------- verify
def _verify(args) -> int:
    from . import GroupedBatch
    from .models import build_model
    from .equivalence import verify, vocab_size

    dtype = DTYPES[args.dtype]
    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).to(dtype).eval()
    else:
        model = build_model(args.arch, dtype=dtype, seed=args.seed)
    model.to(args.device)
    vocab = vocab_size(model)
    gen = torch.Generator().manual_seed(args.seed)
    shape = args.layout or [(args.prefix_len, args.response_lens)] * args.groups
    prompts = [torch.randint(0, vocab, (p,), generator=gen) for p, _ in shape]
    responses = [[torch.randint(0, vocab, (n,), generator=gen) for n in lens] for _, lens in shape]
    batch = GroupedBatch.from_groups(prompts, responses)
    tol = {k: v for k, v in (("logits", args.tol_logits), ("logprobs", args.tol_logprobs),
                             ("grads", args.tol_grads)) if v is not None}
    report = verify(model, batch, dtype=dtype, backend=args.backend, tol=tol, seed=args.seed)
    print("layout: " + "; ".join(f"prompt {p} + responses {','.join(map(str, lens))}" for p, lens in shape))
    print(report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
