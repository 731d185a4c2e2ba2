"""The ``flexgroup demo`` harness: a few GRPO steps three ways, timed in interleaved order.

The G sequences ``[P; R_i]`` right-padded into one batch through the stock model (as trainers run
them), each ``[P; R_i]`` alone through the stock model (no padding work: the fair baseline and the
exactness oracle), and the packed row through flexgroup; :func:`run` prints work, time (median and
spread), memory, loss and the differences. The command line (arguments, exit status) is
:mod:`flexgroup.cli`'s.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

from .measure import sync

__all__ = ["run", "response_lens"]


class _Run:
    """One of the three demo runs: a model, how it turns the batch into [N, Rmax] log-probs, its record."""

    def __init__(self, name: str, model, logp_fn, device: str):
        self.name, self.model, self.logp_fn, self.device = name, model, logp_fn, device
        self.times: list[float] = []      # wall seconds per step
        self.cpu_times: list[float] = []  # process CPU seconds (all threads): robust on a shared machine
        self.losses: list[float] = []
        self.peak: int | None = None      # CUDA bytes allocated above the start of the step
        self.old = None                   # [N, Rmax] log-probs of step 1: the sampling policy, also the KL reference

    def step(self, adv, mask, args, record: bool = True) -> None:
        """One timed forward + backward of the GRPO loss (gradients left in ``self.model``)."""
        from ..train.grpo import policy_loss

        self.model.zero_grad(set_to_none=True)
        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            start_mem = torch.cuda.memory_allocated()
        sync(self.device)
        t0, c0 = time.perf_counter(), time.process_time()
        logp = self.logp_fn()
        old = self.old if self.old is not None else logp.detach()
        loss = policy_loss(logp, old, adv, mask, aggregation=args.aggregation, max_len=mask.shape[1],
                           ref_logp=old, beta=args.beta)
        loss.backward()
        sync(self.device)
        if not record:
            return
        self.times.append(time.perf_counter() - t0)
        self.cpu_times.append(time.process_time() - c0)
        self.losses.append(loss.item())
        if cuda:
            self.peak = max(self.peak or 0, torch.cuda.max_memory_allocated() - start_mem)
        if self.old is None:
            self.old = logp.detach()


def response_lens(R: int, G: int) -> list[int]:
    """G response lengths spread evenly from about R/2 to R: ceil(R (G + i + 1) / 2G)."""
    return [max(1, -(-R * (G + i + 1) // (2 * G))) for i in range(G)]


def _demo_inputs(args, vocab: int, P: int, R: int, gen: torch.Generator):
    """Prompts, responses, rewards [N] and the padded baseline's right-padded ``[N, P + Rmax]`` tensors."""
    lens = response_lens(R, args.group_size)
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
    return prompts, responses, seqs, ids, attn, rewards


def _response_logp(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [..., T + 1, V] (the last row unused), targets [..., T] -> log-probs [..., T] (float32 or wider)."""
    logits = logits[..., :-1, :]
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]


def _build_runs(args, P: int, R: int, models, gen, dtype):
    """The three runs over one batch of ``args.groups`` groups; returns (runs, batch, adv [N], mask [N, Rmax])."""
    from .. import GroupedBatch
    from ..train.grpo import group_advantages

    padded_model, alone_model, grouped_model = models
    vocab = padded_model.config.get_text_config().vocab_size
    prompts, responses, seqs, ids, attn, rewards = _demo_inputs(args, vocab, P, R, gen)
    dev = args.device
    batch = GroupedBatch.from_groups(prompts, responses)
    ids, attn = ids.to(dev), attn.to(dev)
    Rmax = ids.shape[1] - P
    alone = [torch.cat([p, r]).to(dev)[None] for p, r in seqs]

    def padded_logp():  # what trainers do: one right-padded batch, logits only for the completion (TRL)
        out = padded_model(input_ids=ids, attention_mask=attn, logits_to_keep=Rmax + 1, use_cache=False)
        return _response_logp(out.logits, ids[:, P:])  # [N, Rmax]

    def alone_logp():  # every [P; R_i] by itself: no padding, the exactness oracle
        rows = []
        for x in alone:
            n = x.shape[1] - P
            out = alone_model(input_ids=x, logits_to_keep=n + 1, use_cache=False)
            rows.append(_response_logp(out.logits[0], x[0, P:]))
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [N, Rmax]

    inputs = batch.model_inputs(dev, needed_logits_only=True)  # LM head on the rows log-probs read

    def grouped_logp():
        return batch.logprobs(grouped_model(**inputs).logits)  # [N, Rmax]

    mask = batch.response_mask.to(dev)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    adv = group_advantages(rewards, group_size=args.group_size).to(dev, work)
    runs = (_Run("padded batch", padded_model, padded_logp, dev), _Run("each alone", alone_model, alone_logp, dev),
            _Run("flexgroup", grouped_model, grouped_logp, dev))
    return runs, batch, adv, mask


class _Progress:
    """Progress on stderr: a bar redrawn in place on a terminal, one plain line per step otherwise."""

    def __init__(self, total: int, metric: str, width: int = 24):
        self.total, self.metric, self.width = total, metric, width
        self.tty = sys.stderr.isatty()

    def running(self, step: int, done: int, name: str) -> None:
        if self.tty:
            frac = (3 * (step - 1) + done) / (3 * self.total)
            bar = "#" * int(self.width * frac) + "." * (self.width - int(self.width * frac))
            print(f"\rstep {step}/{self.total} [{bar}] running {name}...".ljust(78), end="", file=sys.stderr,
                  flush=True)

    def step_done(self, step: int, runs) -> None:
        times = ", ".join(f"{r.name} {self._time(r):.2f} s" for r in runs)
        losses = " / ".join(f"{r.losses[-1]:+.6f}" for r in runs)
        line = f"step {step}/{self.total}: {self.metric} {times}; loss {losses}"
        print(f"\r{line.ljust(78)}" if self.tty else line, file=sys.stderr, flush=True)

    def _time(self, run) -> float:
        return (run.cpu_times if self.metric == "cpu time" else run.times)[-1]


def _ratios(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the per-step ratios num[s] / den[s] (the steps were interleaved)."""
    r = [a / b for a, b in zip(num, den)]
    return statistics.median(r), min(r), max(r)


def run(args, cfg, lens: list[int], dtype: torch.dtype) -> bool:
    """The demo's three runs, table and verdict on stdout; True when flexgroup matches each sequence alone."""
    import flexgroup

    from .. import kernels
    from ..verification.equivalence import default_tolerances, grad_difference
    from ..reference.stock import stock_attention
    from ..models.zoo import build_model, flops_per_token_and_pair

    t_start = time.perf_counter()
    dev = args.device
    P, G, N = args.prefix_len, args.group_size, args.groups * args.group_size
    metric = "cpu time" if dev == "cpu" else "time"
    hkv = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    auto = f" -> {kernels.resolve('auto', dev, True).name} on {dev}" if args.backend == "auto" else ""
    stock = stock_attention(cfg)
    threads = (f", {torch.get_num_threads()} torch thread(s)"
               + (" (--threads N to change)" if not args.threads else "") if dev == "cpu" else "")
    print(f"flexgroup demo: {args.arch} (hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, "
          f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads / {hkv} KV, vocab {cfg.vocab_size}, "
          f"positions up to {getattr(cfg, 'max_position_embeddings', 'any')}; random weights), {args.dtype}, {dev}{threads}")
    print(f"batch: {args.groups} group(s), prompt {P} tokens, {G} responses of {min(lens)}..{max(lens)} tokens; "
          "toy reward = share of even token ids")
    print(f"loss: clipped policy gradient ({args.aggregation}) + {args.beta} x KL(k3) to the step-1 policy; "
          f"{args.steps} step(s), AdamW (lr {args.lr:g}) between them")
    print(f"three runs, timed in turn within every step (forward + backward of the loss, {metric}):")
    print(f"  padded batch  the {N} sequences [P; R_i] right-padded into one batch, stock model ({stock}): "
          "what trainers run")
    print(f"  each alone    every [P; R_i] by itself, stock model ({stock}): no padding work (the fair "
          "baseline, and the exactness reference)")
    print(f"  flexgroup     one packed row, each prompt once, patched copy (backend {args.backend!r}{auto})")
    print(flush=True)

    base = build_model(args.arch, dtype=dtype, seed=args.seed, size=args.size).to(dev)
    models = (base, copy.deepcopy(base), flexgroup.patch(copy.deepcopy(base), backend=args.backend))
    gen = torch.Generator().manual_seed(args.seed + 1)
    # Warm-up: first-call costs (allocator, thread pool, torch.compile on cuda) stay out of the timing.
    # On CPU a small problem through the same code suffices; compiled kernels need the real shapes.
    wP, wR = (P, args.response_len) if dev == "cuda" else (min(P, 32), min(args.response_len, 8))
    wruns, _, wadv, wmask = _build_runs(args, wP, wR, models, gen, dtype)
    for run in wruns:
        run.step(wadv, wmask, args, record=False)

    runs, batch, adv, mask = _build_runs(args, P, args.response_len, models, gen, dtype)
    padded, alone, grp = runs
    opts = [torch.optim.AdamW(r.model.parameters(), lr=args.lr) for r in runs] if args.steps > 1 else []
    progress = _Progress(args.steps, metric)
    for s in range(1, args.steps + 1):
        order = runs[(s - 1) % 3:] + runs[:(s - 1) % 3]  # rotate who goes first: no run always warm or cold
        for k, run in enumerate(order):
            progress.running(s, k, run.name)
            run.step(adv, mask, args)
        if s == 1:  # step 1: every difference against each sequence alone, before any optimizer step
            diffs = {r.name: (_logp_difference(r.old, alone.old, mask),
                              grad_difference(r.model, alone.model)) for r in (padded, grp)}
        progress.step_done(s, runs)
        if s < args.steps:
            for opt in opts:
                opt.step()

    tol = default_tolerances(dtype)
    d_lp, (_, g_rel, g_name, _) = diffs["flexgroup"]
    ok = d_lp <= tol["logprobs"] and g_rel <= tol["grads"]
    cost = batch.cost()
    ideal = cost.ideal_speedup(*flops_per_token_and_pair(cfg))
    Lpad = P + max(lens)
    series = (lambda r: r.cpu_times) if metric == "cpu time" else (lambda r: r.times)

    def timing(t: list[float]) -> str:
        return f"{statistics.median(t):.3f} s" + (f" ({min(t):.2f}-{max(t):.2f})" if len(t) > 1 else "")

    def mean_logp(r) -> float:
        return float(torch.where(mask, r.old.double(), 0).sum() / mask.sum())

    rows = [
        ("tokens processed", f"{N * Lpad:,} ({N * Lpad - cost.baseline_tokens:,} pad)", f"{cost.baseline_tokens:,}",
         f"{cost.grouped_tokens:,}"),
        ("causal attention pairs", f"{N * Lpad * (Lpad + 1) // 2:,}", f"{cost.baseline_pairs:,}",
         f"{cost.grouped_pairs:,}"),
        (f"{metric} / step", *(timing(series(r)) for r in runs)),
        *([("wall time / step", *(timing(r.times) for r in runs))] if metric == "cpu time" else []),
        *([("peak memory (step)", *(f"{r.peak / 2**20:,.1f} MiB" for r in runs))] if dev == "cuda" else []),
        ("mean log-prob (step 1)", *(f"{mean_logp(r):+.8f}" for r in runs)),
        ("loss (step 1)", *(f"{r.losses[0]:+.8f}" for r in runs)),
        *([(f"loss (step {args.steps})", *(f"{r.losses[-1]:+.8f}" for r in runs))] if args.steps > 1 else []),
        ("max |d log-prob|", f"{diffs['padded batch'][0]:.2e}", "(reference)", f"{d_lp:.2e}"),
        ("max rel |d grad|", f"{diffs['padded batch'][1][1]:.2e}", "(reference)", f"{g_rel:.2e}"),
    ]
    print()
    print(f"{'':<23}{'padded batch':>24}{'each alone':>24}{'flexgroup':>24}")
    for name, *cells in rows:
        print(f"{name:<23}" + "".join(f"{c:>24}" for c in cells))
    print(f"(times: median over {args.steps} step(s), range in parentheses; differences: step 1 against each "
          f"alone, tolerance {tol['logprobs']:.0e} log-prob, {tol['grads']:.0e} relative gradient; largest "
          f"gradient difference of flexgroup in {g_name})")
    print()
    sa, sp = _ratios(series(alone), series(grp)), _ratios(series(padded), series(grp))
    print(f"equivalent: {'yes' if ok else 'no'} (max |dlogp| = {d_lp:.1e}, max rel |dgrad| = {g_rel:.1e})")
    print(f"speedup: {sa[0]:.2f}x vs each sequence alone (ideal {ideal:.2f}x), {sp[0]:.2f}x vs the padded batch")
    print(f"  median of {args.steps} interleaved step(s) of {'process CPU time' if metric == 'cpu time' else 'time'}"
          + (f" ({sa[1]:.2f}-{sa[2]:.2f}x and {sp[1]:.2f}-{sp[2]:.2f}x)" if args.steps > 1 else "")
          + (f", {torch.get_num_threads()} torch thread(s)" if dev == "cpu" else "")
          + "; timings vary between runs and machines")
    if sa[0] > ideal:  # not a measuring error: the ideal leaves out costs that the G separate calls pay G times
        print("  above the ideal: the ideal counts the decoder's arithmetic only, while running each sequence alone "
              "also pays fixed per-call costs (Python, kernel launches) once per sequence")
    print(f"(total {time.perf_counter() - t_start:.1f} s)", file=sys.stderr)
    return ok


def _logp_difference(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    """max |logp - ref| over the response tokens (``mask`` [N, Rmax])."""
    return float(torch.where(mask, (logp.double() - ref.double()).abs(), 0).max())
