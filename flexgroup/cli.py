"""The ``flexgroup`` command: ``demo``, ``verify``, ``bench`` and ``doctor``.

``flexgroup demo`` runs GRPO steps on a built-in random model three ways in turn (a right-padded batch and
each ``[P; R_i]`` alone through the stock model, the packed row through flexgroup: :mod:`flexgroup.bench.demo`);
``flexgroup verify`` runs :func:`flexgroup.verify`; ``flexgroup bench`` is :mod:`flexgroup.bench`'s;
``flexgroup doctor`` is :mod:`flexgroup.bench.doctor`'s.
Exit status: 0 success (equivalent), 1 not equivalent, 2 a usage or input error (one line on stderr),
3 an unexpected error (one line; ``--debug`` shows the traceback). Arguments (and a ``--model`` path) are
checked before torch is imported: the choices below are literal copies, checked by tests/cli/test_cli.py.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import TYPE_CHECKING, Callable, Sequence

from .bench.arguments import group_layout, int_list, nonnegative_float, positive_int

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")
# copies of flexgroup.models.zoo.ARCHS, flexgroup.kernels.BACKEND_NAMES, flexgroup.verification.calibration.CALIBRATIONS
ARCH_NAMES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "olmo2", "granite", "smollm3", "qwen3_5_text",
              "qwen3_next", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "olmo_hybrid")
BACKEND_NAMES = ("auto", "flex", "flex_eager", "sdpa", "lse")
CALIBRATION_NAMES = ("auto", "float64", "layerwise", "spread", "none")
EXIT_NOT_EQUIVALENT, EXIT_USAGE, EXIT_UNEXPECTED = 1, 2, 3
SMALL_MACHINE_CORES = 4  # at most this many CPU cores: demo and bench time with 1 torch thread by default


class UsageError(Exception):
    """An argument or input the command cannot use: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(f"{message} (`{self.prog} --help` lists the options)")

    def parse_args(self, args=None, namespace=None):  # a subcommand's unknown flag: point to ITS --help
        args, extra = self.parse_known_args(args, namespace)
        if extra:
            self.prog += f" {args.command}" if getattr(args, "command", None) else ""
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return args


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _installed(dist: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:  # e.g. a source build without package metadata
        return "unknown"


def _version() -> str:
    """The ``--version`` line, read from the package metadata: importing torch would take seconds."""
    from . import __version__

    return f"flexgroup {__version__} (torch {_installed('torch')}, transformers {_installed('transformers')})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="flexgroup",
        description="Shared-prefix (grouped) forward for GRPO-style training, exact against the baseline.",
        epilog="exit status: 0 success, 1 not equivalent, 2 usage or input error, 3 unexpected error "
               "(--debug shows its traceback)")
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="{demo,verify,bench,doctor}", required=True)

    def common(p: argparse.ArgumentParser, dtype: str) -> None:
        p.add_argument("--dtype", choices=DTYPE_NAMES, default=dtype, help=f"parameter dtype (default {dtype})")
        p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="device (default cpu); on cuda the 'auto' backend is compiled flex attention")
        p.add_argument("--backend", choices=BACKEND_NAMES, default="auto",
                       help="flexgroup attention backend (default auto: flex on cuda, exact lse on cpu)")
        p.add_argument("--seed", type=int, default=0, help="seed of weights and tokens (default 0)")
        p.add_argument("--debug", action="store_true", help="show the traceback of an error")

    demo = sub.add_parser(
        "demo", help="GRPO steps three ways: same numbers, less work",
        description="A few GRPO steps on a built-in random model, three ways in turn: a right-padded batch and each "
        "[P; R_i] alone through the stock model, one packed row through flexgroup. Prints work, time (median and "
        "range), loss and the differences from each-alone. The defaults take 30-45 s of CPU time (1 thread) "
        "and about 2.4 GB of memory; the wall time is longer on a busy machine.")
    demo.add_argument("--arch", choices=ARCH_NAMES, default="llama", help="architecture (default llama)")
    demo.add_argument("--size", choices=("demo", "tiny"), default="demo",
                      help="model size preset (default demo: hidden 256, 4 layers, positions up to 4096)")
    demo.add_argument("--prefix-len", type=positive_int, default=1024, help="prompt tokens P (default 1024)")
    demo.add_argument("--group-size", type=positive_int, default=8, help="responses per prompt G (default 8)")
    demo.add_argument("--response-len", type=positive_int, default=128,
                      help="longest response; the G lengths spread evenly from about half of it (default 128); "
                           "prefix + response must fit the model's positions (4096)")
    demo.add_argument("--groups", type=positive_int, default=1, help="prompts (groups) in the batch (default 1)")
    demo.add_argument("--steps", type=positive_int, default=3,
                      help="GRPO steps, each timing the three runs in turn, AdamW between them (default 3)")
    demo.add_argument("--lr", type=nonnegative_float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    demo.add_argument("--aggregation", choices=("token-mean", "sequence-mean", "fixed"), default="token-mean",
                      help="loss aggregation (default token-mean, DAPO)")
    demo.add_argument("--threads", type=positive_int,
                      help=f"CPU threads for torch (default 1 on machines with <= {SMALL_MACHINE_CORES} CPU "
                           "cores, where more threads made timings swing, else torch's choice)")
    demo.add_argument("--beta", type=nonnegative_float, default=0.04, help="KL coefficient (default 0.04)")
    common(demo, "float32")

    ver = sub.add_parser("verify", help="check grouped == repeated-prefix baseline on a model",
                         description="Run flexgroup.verify: grouped forward/backward of a patched copy versus each "
                         "[P; R_i] alone through an unpatched copy; exit status 1 beyond tolerance.")
    src = ver.add_mutually_exclusive_group()
    src.add_argument("--arch", choices=ARCH_NAMES,
                     help="a tiny built-in config of this architecture (default llama when --model is not given)")
    src.add_argument("--model", metavar="PATH", help="a local Hugging Face model directory, or a hub id already in "
                     "the local Hugging Face cache (offline: never downloads)")
    ver.add_argument("--prefix-len", type=positive_int, default=24, help="prompt tokens per group (default 24)")
    ver.add_argument("--response-lens", type=int_list, default=[5, 12, 1, 9], metavar="N,N,...",
                     help="response lengths of each group (default 5,12,1,9)")
    ver.add_argument("--groups", type=positive_int, default=2, help="groups packed in the row (default 2)")
    ver.add_argument("--layout", type=group_layout, metavar="P:R,R;P:R,...",
                     help="groups of different shapes, e.g. 24:5,12,1;6:3,3 (replaces the three options above)")
    ver.add_argument("--tol-logits", type=nonnegative_float, help="max |diff| of logits (default by dtype)")
    ver.add_argument("--tol-logprobs", type=nonnegative_float, help="max |diff| of log-probs (default by dtype)")
    ver.add_argument("--tol-grads", type=nonnegative_float, help="max relative gradient diff (default by dtype)")
    ver.add_argument("--freeze-embeddings", action="store_true",
                     help="no gradients for the embeddings (not compared): saves memory on large vocabularies")
    ver.add_argument("--calibration", choices=CALIBRATION_NAMES, default="auto",
                     help="the rounding the verdict is judged against (default auto: float64 where its copy fits, "
                          "else layerwise): float64 = a float64 copy of the stock model; layerwise = the same truth, "
                          "one block in float64 at a time; spread = the stock model's own spread; none = fixed "
                          "tolerances (docs/verify.md)")
    common(ver, "float32")

    sub.add_parser("doctor", help="versions, and which built-in architectures patch supports here (each checked "
                   "against each sequence alone on a tiny model; exit status 1 when a supported one fails)")
    sub.add_parser("bench", add_help=False, help=f"benchmarks (flexgroup bench --help); --threads 1 unless given, on "
                   f"machines with <= {SMALL_MACHINE_CORES} CPU cores")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flexgroup`` console script; returns the exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    prog = "flexgroup" + (f" {argv[0]}" if argv and argv[0] in ("demo", "verify", "bench", "doctor") else "")
    try:
        if argv and argv[0] == "bench":
            return _bench(_bench_argv([a for a in argv[1:] if a != "--debug"]))
        args = build_parser().parse_args(argv)
        if args.command == "doctor":
            return importlib.import_module("flexgroup.bench.doctor").run()
        if getattr(args, "model", None):
            _model_directory(args.model)  # a mistyped path is reported at once, before torch is imported
        _check_device(args)
        return run_demo(args) if args.command == "demo" else _verify(args)
    except UsageError as e:
        if debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 -- one line instead of a traceback; --debug re-raises
        if debug:
            raise
        print(f"{prog}: error: {type(e).__name__}: {_one_line(e)} (run again with --debug for the traceback)",
              file=sys.stderr)
        return EXIT_UNEXPECTED


def _check_device(args) -> None:
    """UsageError unless ``args.device`` exists and ``args.backend`` can train there."""
    import torch

    from . import kernels

    if args.device == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None:  # a CPU-only build: no GPU can help
            raise UsageError(f"--device cuda: this PyTorch build is CPU-only ({torch.__version__}); use --device cpu, "
                             "or install a CUDA build of torch (docs/gpu.md)")
        raise UsageError(f"--device cuda: this PyTorch build supports CUDA {torch.version.cuda} ({torch.__version__}) "
                         "but sees no GPU: check the GPU and its driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, or "
                         "use --device cpu")
    try:
        kernels.resolve(args.backend, args.device, needs_grad=True)
    except NotImplementedError as e:
        raise UsageError(f"--backend {args.backend} cannot train on {args.device.upper()}: it has no backward pass "
                         "there; use --backend auto (the default) or --backend sdpa" if "cannot train" in str(e) else
                         f"--backend {args.backend} on {args.device}: {_one_line(e)}") from e


def _bench_argv(argv: list[str]) -> list[str]:
    """``argv`` plus ``--threads 1`` on machines with <= SMALL_MACHINE_CORES cores unless it sets threads."""
    if any(a.startswith("--threads") or a in ("-h", "--help") for a in argv):
        return argv
    return argv + ["--threads", "1"] if (os.cpu_count() or 1) <= SMALL_MACHINE_CORES else argv


def _bench(argv: list[str]) -> int:
    try:
        bench = importlib.import_module("flexgroup.bench")
    except ModuleNotFoundError as e:
        if e.name not in ("flexgroup.bench",):
            raise
        print("flexgroup bench: not available in this installation (module flexgroup.bench is missing); "
              "run the benchmarks in benchmarks/ with pytest instead", file=sys.stderr)
        return EXIT_USAGE
    return int(bench.main(argv) or 0)


def _check_positions(config, needed: int, what: str, fix: str) -> None:
    """UsageError if ``needed`` positions (0 .. needed-1) exceed ``config.max_position_embeddings``."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and needed > limit:
        raise UsageError(f"{what} needs {needed} positions, beyond the model's limit of {limit} "
                         f"(max_position_embeddings): {fix}")


# ---------------------------------------------------------------------------- demo (the harness: flexgroup.bench.demo)
def run_demo(args) -> int:
    """``flexgroup demo``; returns 0 when flexgroup matches each sequence alone, 1 otherwise."""
    import torch

    from .bench.demo import response_lens, run
    from .models.zoo import tiny_config

    P, R = args.prefix_len, args.response_len
    lens = response_lens(R, args.group_size)
    cfg = tiny_config(args.arch, args.size).get_text_config()
    _check_positions(cfg, P + max(lens), f"--prefix-len {P} with --response-len {R}",
                     f"keep --prefix-len + --response-len <= {getattr(cfg, 'max_position_embeddings', 0)}")
    threads_before = torch.get_num_threads()
    threads = args.threads or (1 if args.device == "cpu" and (os.cpu_count() or 1) <= SMALL_MACHINE_CORES else None)
    if threads:
        torch.set_num_threads(threads)
    try:
        return 0 if run(args, cfg, lens, getattr(torch, args.dtype)) else EXIT_NOT_EQUIVALENT
    finally:
        torch.set_num_threads(threads_before)


# ---------------------------------------------------------------------------- verify
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _model_directory(text: str) -> str:
    """The local directory of ``--model``: a directory with a config.json, or a hub id's snapshot in the
    local Hugging Face cache (looked up with ``local_files_only``: nothing is downloaded); else UsageError."""
    path = os.path.expanduser(text)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UsageError(f"--model {text}: the directory has no config.json; pass a Hugging Face model "
                             "directory (what save_pretrained writes)")
        return path
    if os.path.exists(path):
        raise UsageError(f"--model {text}: is a file, not a model directory; pass the directory that holds "
                         "config.json and the weights")
    if _HUB_ID.match(text):
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(text, local_files_only=True)
        except Exception:  # noqa: BLE001 -- not in the cache (or no huggingface_hub): say how to get it
            pass
        raise UsageError(f"--model {text}: no directory of that name, and no copy of the hub model {text!r} in the "
                         "local Hugging Face cache; flexgroup loads models offline and never downloads: "
                         f"download it first (`hf download {text}`) or pass its local directory")
    raise UsageError(f"--model {text}: directory does not exist ({os.path.abspath(path)}); pass a local "
                     "Hugging Face model directory")


def _check_supported(model, text: str) -> None:
    """UsageError naming the model type and the reason when flexgroup cannot patch ``model`` at all."""
    from .patches import HYBRIDS, REGISTRY, find_language_model

    model_type = model.config.model_type
    if model_type in REGISTRY:
        return
    try:
        find_language_model(model, "model")
    except TypeError:
        raise UsageError(
            f"--model {text}: model type {model_type!r} ({type(model).__name__}) is not supported: flexgroup "
            "patches decoders that keep their layers at .model.layers and call attention through transformers' "
            f"attention interface (Llama-style); {type(model).__name__} has no .layers or .model.layers. "
            f"Dedicated patches: {', '.join(sorted({*REGISTRY, *HYBRIDS}))}; other Llama-style decoders after a "
            "self-check") from None


def _load_model(text: str, dtype: torch.dtype):
    """``AutoModelForCausalLM`` from the local directory of ``--model`` (offline), checked to be patchable."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    path = _model_directory(text)
    hf_logging.disable_progress_bar()  # the command's output is the report
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {text}: transformers cannot load it as a causal language model: "
                         f"{_one_line(e)}") from e
    _check_supported(model, text)
    return model.to(dtype).eval()


def _verify(args) -> int:
    import torch

    from . import GroupedBatch
    from .verification.equivalence import verify, vocab_size
    from .models.zoo import build_model, unavailable

    if not args.model and not args.arch:
        args.arch = "llama"
        print("flexgroup verify: no --model or --arch given: checking the built-in tiny llama (--model DIR: yours)")
    if not args.model and (why := unavailable(args.arch)):
        raise UsageError(f"--arch {args.arch}: {why} (`flexgroup doctor` lists what runs here)")
    dtype = getattr(torch, args.dtype)
    shape = args.layout or [(args.prefix_len, args.response_lens)] * args.groups
    model = _load_model(args.model, dtype) if args.model else build_model(args.arch, dtype=dtype, seed=args.seed)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    _check_positions(cfg, max(p + max(lens) for p, lens in shape), "the longest [prompt; response]",
                     "use shorter --prefix-len / --response-lens / --layout")
    model.to(args.device)
    if args.freeze_embeddings:
        for emb in (model.get_input_embeddings(), model.get_output_embeddings()):
            if emb is not None:
                emb.weight.requires_grad_(False)
    vocab = vocab_size(model)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, vocab, (p,), generator=gen) for p, _ in shape]
    responses = [[torch.randint(0, vocab, (n,), generator=gen) for n in lens] for _, lens in shape]
    batch = GroupedBatch.from_groups(prompts, responses)
    tol = {k: v for k, v in (("logits", args.tol_logits), ("logprobs", args.tol_logprobs),
                             ("grads", args.tol_grads)) if v is not None}
    try:
        report = verify(model, batch, dtype=dtype, backend=args.backend, tol=tol, seed=args.seed,
                        calibration=args.calibration)
    except (ValueError, TypeError, NotImplementedError) as e:  # flexgroup's refusals name the cause and the fix
        what = args.model or f"--arch {args.arch}"
        raise UsageError(f"{what} ({cfg.model_type}): {_one_line(e)}") from e
    print("layout: " + "; ".join(f"prompt {p} + responses {','.join(map(str, lens))}" for p, lens in shape))
    print(f"token ids: uniform random over the whole vocabulary [0, {vocab}), seed {args.seed} (rare and untrained "
          "rows included: harsher on rounding than text)")
    print(report.table())
    return 0 if report.ok else EXIT_NOT_EQUIVALENT


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def model_directory(text: str, *, tokenizer: bool = False) -> str:
    """The local directory of a model given as a path or as a hub id already in the local Hugging Face cache
    (offline), for scripts; :class:`UsageError` (one line with the fix) when there is none, or, with
    ``tokenizer=True``, when it has no tokenizer files."""
    path = _model_directory(text)
    if tokenizer and not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise UsageError(f"--model {text}: the directory has no tokenizer ({', '.join(_TOKENIZER_FILES[:2])}, ...); "
                         "save the checkpoint's tokenizer beside the weights (tokenizer.save_pretrained(dir))")
    return path


def run_script(prog: str, run: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """``run(argv)``, with a :class:`UsageError` or a missing optional dependency printed as one line
    ``<prog>: error: <message>`` and exit status 2, as the ``flexgroup`` command does: the examples' ``main``."""
    from .integrations import install_hint

    try:
        return run(argv)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ImportError as e:  # a missing extra (also an integration's ImportError raised from it): the install line
        if install_hint(e) is None:
            raise
        print(f"{prog}: error: {install_hint(e)}", file=sys.stderr)
        return EXIT_USAGE
