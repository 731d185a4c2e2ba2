"""The ``flexgroup`` command: demo and verify end to end (tiny sizes), one-line errors with their exit
status, offline model loading, the bench hook."""

import importlib
import os
import pathlib
import re
import socket
import subprocess
import sys
import types

import importlib.metadata

import pytest
import torch

from flexgroup.cli import main

TINY_DEMO = ["demo", "--size", "tiny", "--prefix-len", "24", "--group-size", "3", "--response-len", "6"]
EQUIVALENT = re.compile(r"^equivalent: (yes|no) \(max \|dlogp\| = \S+, max rel \|dgrad\| = \S+\)$", re.M)
SPEEDUP = re.compile(r"^speedup: \d+\.\d\dx vs each sequence alone \(ideal \d+\.\d\dx\), "
                     r"\d+\.\d\dx vs the padded batch$", re.M)


def test_demo_prints_the_header_the_table_and_the_summary_and_exits_zero(capsys):
    assert main(TINY_DEMO) == 0
    out = capsys.readouterr().out
    assert out.startswith("flexgroup demo: llama (hidden 64")
    assert "positions up to 4096" in out and "1 torch thread" in out or "torch thread" in out
    for row in ("tokens processed", "causal attention pairs", "cpu time / step", "wall time / step",
                "loss (step 1)", "loss (step 3)", "max |d log-prob|", "max rel |d grad|"):
        assert row in out
    assert "peak memory" not in out  # no fake CPU memory number
    assert EQUIVALENT.search(out).group(1) == "yes", out
    assert SPEEDUP.search(out), out
    assert "median of 3 interleaved step(s) of process CPU time" in out
    assert "timings vary between runs and machines" in out


def test_demo_counts_tokens_and_pairs_of_each_run(capsys):
    # P = 24, G = 3, R = 6: lengths ceil(6 * (3 + i + 1) / 6) = 4, 5, 6
    # padded: 3 rows of 30 = 90 tokens (3 pad), pairs 3 * 30 * 31 / 2 = 1395
    # each alone: 28 + 29 + 30 = 87 tokens, pairs (28*29 + 29*30 + 30*31) / 2 = 1306
    # flexgroup: 24 + 15 = 39 tokens, pairs 24*25/2 + 24*15 + (10 + 15 + 21) = 706
    main(TINY_DEMO)
    out = capsys.readouterr().out
    assert re.search(r"tokens processed\s+90 \(3 pad\)\s+87\s+39\n", out), out
    assert re.search(r"causal attention pairs\s+1,395\s+1,306\s+706\n", out), out
    assert "3 responses of 4..6 tokens" in out


def test_demo_header_comes_before_the_progress_and_the_losses_stay_together(capsys, monkeypatch):
    printed = []
    monkeypatch.setattr("builtins.print", lambda *a, file=None, **k: printed.append(
        ("err" if file is sys.stderr else "out", " ".join(map(str, a)))))
    assert main(TINY_DEMO + ["--steps", "3", "--groups", "2"]) == 0
    first_progress = next(i for i, (f, line) in enumerate(printed) if line.startswith("step 1/3"))
    assert printed[0][1].startswith("flexgroup demo:") and first_progress > 3
    steps = [re.search(r"^step (\d)/3: cpu time padded batch \S+ s, each alone \S+ s, flexgroup \S+ s; "
                       r"loss (\S+) / (\S+) / (\S+)$", line) for f, line in printed if f == "err" and
             line.startswith("step")]
    assert [m.group(1) for m in steps] == ["1", "2", "3"]  # plain lines: stderr is not a terminal here
    assert all(abs(float(m.group(2)) - float(m.group(4))) < 1e-4 for m in steps)
    assert all(abs(float(m.group(3)) - float(m.group(4))) < 1e-4 for m in steps)
    assert float(steps[0].group(4)) != float(steps[2].group(4))  # the optimizer moved the policy


def test_demo_exits_one_when_flexgroup_differs_from_each_sequence_alone(capsys, causal_over_packed_row):
    assert main(TINY_DEMO + ["--steps", "1"]) == 1
    assert EQUIVALENT.search(capsys.readouterr().out).group(1) == "no"


def test_demo_runs_other_architectures_and_dtypes(capsys):
    assert main(TINY_DEMO + ["--arch", "gemma2", "--dtype", "float64", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "stock model (eager)" in out and "float64" in out


def test_demo_uses_one_thread_on_small_machines_and_restores_the_setting(capsys, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    before = torch.get_num_threads()
    assert main(TINY_DEMO + ["--steps", "1"]) == 0
    assert "cpu, 1 torch thread(s) (--threads N to change)" in capsys.readouterr().out
    assert torch.get_num_threads() == before


def test_demo_refuses_positions_beyond_the_model_limit_before_any_work(capsys, monkeypatch):
    import flexgroup.models.zoo

    def no_work(*args, **kwargs):
        raise AssertionError("the demo built a model before validating its arguments")

    monkeypatch.setattr(flexgroup.models.zoo, "build_model", no_work)
    assert main(["demo", "--prefix-len", "4096", "--response-len", "64"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("flexgroup demo: error: --prefix-len 4096 with --response-len 64 needs 4160 positions, "
                            "beyond the model's limit of 4096 (max_position_embeddings): keep --prefix-len + "
                            "--response-len <= 4096\n")


def test_verify_command_passes_and_prints_the_differences(capsys):
    assert main(["verify", "--arch", "qwen3", "--response-lens", "3,1,8", "--groups", "2"]) == 0
    out = capsys.readouterr().out
    assert "logprobs" in out and "grads" in out and "equivalent: yes" in out
    assert "token ids: uniform random over the whole vocabulary [0, " in out   # says what its inputs are


def test_bare_verify_checks_the_built_in_tiny_llama_and_says_so(capsys):
    assert main(["verify"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("flexgroup verify: no --model or --arch given: checking the built-in tiny llama")
    assert "equivalent: yes" in out


def test_verify_command_takes_a_layout_of_groups_of_different_shapes(capsys):
    assert main(["verify", "--arch", "mistral", "--layout", "30:5,12,1;3:7,2;9:1"]) == 0
    out = capsys.readouterr().out
    assert "layout: prompt 30 + responses 5,12,1; prompt 3 + responses 7,2; prompt 9 + responses 1" in out
    assert "6 responses: 70 tokens packed vs 133 one by one" in out  # 30+18 + 3+9 + 9+1; 35+42+31+10+5+10


def test_verify_command_exits_one_when_not_equivalent(capsys, causal_over_packed_row):
    assert main(["verify", "--arch", "llama"]) == 1
    assert "equivalent: no" in capsys.readouterr().out


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("flexgroup tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_verify_command_on_a_local_model_directory(tmp_path, capsys, no_network):
    from flexgroup.models.zoo import build_model

    build_model("olmo2").save_pretrained(tmp_path)
    assert main(["verify", "--model", str(tmp_path), "--prefix-len", "10"]) == 0
    assert "olmo2" in capsys.readouterr().out


def test_verify_finds_a_hub_id_in_the_local_cache_offline(tmp_path, capsys, monkeypatch, no_network):
    from huggingface_hub import constants

    from flexgroup.models.zoo import build_model

    # the cache layout huggingface_hub writes: models--ORG--NAME/{refs/main, snapshots/<commit>/...}
    repo = tmp_path / "models--someone--tiny-qwen2"
    build_model("qwen2").save_pretrained(repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert main(["verify", "--model", "someone/tiny-qwen2", "--prefix-len", "10"]) == 0
    assert "equivalent: yes" in capsys.readouterr().out


@pytest.mark.parametrize("model, message", [
    ("./does-not-exist", "--model ./does-not-exist: directory does not exist"),
    ("someone/not-downloaded", "--model someone/not-downloaded: no directory of that name, and no copy of the hub "
                               "model 'someone/not-downloaded' in the local Hugging Face cache; flexgroup loads "
                               "models offline and never downloads"),
])
def test_verify_says_what_is_missing_without_reaching_the_network(model, message, tmp_path, capsys, monkeypatch,
                                                                  no_network):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert main(["verify", "--model", model]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexgroup verify: error: " + message) and err.count("\n") == 1, err


def test_verify_names_an_unsupported_architecture_and_why(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=64, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(tmp_path)
    assert main(["verify", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "model type 'gpt2' (GPT2LMHeadModel) is not supported" in err
    assert "has no .layers or .model.layers" in err and err.count("\n") == 1


def test_verify_refuses_a_directory_without_a_config(tmp_path, capsys):
    assert main(["verify", "--model", str(tmp_path)]) == 2
    assert "the directory has no config.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--prefix-len", "0"], "--prefix-len: expected a positive integer, got 0"),
        (["demo", "--group-size", "two"], "--group-size: expected a positive integer, got 'two'"),
        (["demo", "--arch", "gpt9"], "--arch: invalid choice: 'gpt9'"),
        (["demo", "--dtype", "float8"], "--dtype: invalid choice: 'float8'"),
        (["demo", "--threads", "0"], "--threads: expected a positive integer, got 0"),
        (["demo", "--beta", "-1"], "--beta: expected a number >= 0, got -1"),
        (["demo", "--backend", "flex"], "--backend flex cannot train on CPU: it has no backward pass there; use "
                                        "--backend auto (the default) or --backend sdpa"),
        (["demo", "--frobnicate"], "unrecognized arguments: --frobnicate (`flexgroup demo --help` lists the options)"),
        (["verify", "--model", "./no-such-dir"], "--model ./no-such-dir: directory does not exist"),
        (["verify", "--arch", "llama", "--model", "x"], "not allowed with argument"),
        (["verify", "--arch", "llama", "--response-lens", "5,x"],
         "--response-lens: expected a positive integer, got 'x'"),
        (["verify", "--arch", "llama", "--layout", "30;3:7"], "--layout: expected groups like 24:5,12,1;6:3,3"),
        (["verify", "--arch", "llama", "--prefix-len", "4090"], "the longest [prompt; response] needs 4102 "
                                                                 "positions, beyond the model's limit of 4096"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required"),
    ],
)
def test_usage_errors_are_one_line_with_exit_status_two(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("flexgroup") and err.count("\n") == 1, err


@pytest.mark.parametrize("build_cuda, says, not_says", [
    (None, "this PyTorch build is CPU-only", "sees no GPU"),                     # a CPU wheel: install a CUDA build
    ("12.8", "supports CUDA 12.8 (", "install a CUDA build"),                   # a CUDA wheel, no GPU or driver seen
])
def test_cuda_without_a_usable_gpu_says_whether_the_build_or_the_machine_lacks_it(build_cuda, says, not_says,
                                                                                 monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", build_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexgroup demo: error: --device cuda: ") and err.count("\n") == 1, err
    assert says in err and not_says not in err, err
    if build_cuda:
        assert "driver" in err and "--device cpu" in err, err
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    beginning = err.split("error: ", 1)[1][:45]
    assert f"| `{beginning}" in readme, f"README's Troubleshooting table has no row for {beginning!r}"


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    import flexgroup.models.zoo

    def broken(*args, **kwargs):
        raise RuntimeError("something\nbroke")

    monkeypatch.setattr(flexgroup.models.zoo, "build_model", broken)
    assert main(TINY_DEMO) == 3
    assert capsys.readouterr().err.endswith(
        "flexgroup demo: error: RuntimeError: something broke (run again with --debug for the traceback)\n")
    with pytest.raises(RuntimeError, match="something"):
        main(TINY_DEMO + ["--debug"])


def test_version(capsys):
    from flexgroup import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    # --version reads package metadata (no torch import): a PyPI CUDA wheel's metadata has no local label
    # (2.6.0, where torch.__version__ is 2.6.0+cu124)
    assert capsys.readouterr().out.startswith(f"flexgroup {__version__} (torch {importlib.metadata.version('torch')}, "
                                              "transformers ")


def test_bench_hook_reports_a_missing_module(monkeypatch, capsys):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(importlib, "import_module", missing)
    assert main(["bench", "--quick"]) == 2
    assert "flexgroup bench: not available" in capsys.readouterr().err


@pytest.mark.parametrize("cores, argv, passed", [
    (16, ["--quick", "--out", "x.json"], ["--quick", "--out", "x.json"]),
    (2, ["--quick"], ["--quick", "--threads", "1"]),  # small machine: 1 thread unless asked
    (2, ["--quick", "--threads", "2"], ["--quick", "--threads", "2"]),
    (2, ["--help"], ["--help"]),
])
def test_bench_hook_passes_its_arguments_through(cores, argv, passed, monkeypatch):
    seen = []
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setitem(sys.modules, "flexgroup.bench", types.SimpleNamespace(main=lambda argv: seen.append(argv) or 0))
    assert main(["bench", *argv, "--debug"]) == 0
    assert seen == [passed]


def test_python_dash_m_flexgroup_prints_one_line_errors_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "flexgroup", "verify", "--model", "./does-not-exist"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("flexgroup verify: error: --model ./does-not-exist: directory does not exist")
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""


def test_bench_says_which_baseline_its_ratios_are_against_and_why_one_can_pass_the_ideal(monkeypatch, capsys,
                                                                                          tmp_path):
    from flexgroup.bench import harness

    point = dict(prefix=64, response=64, G=4, ratio=1.0, ideal=1.5, results={
        "baseline": {"median_s": 0.2}, "flexgroup": {"median_s": 0.1}}, speedup={"flexgroup": 2.0})
    monkeypatch.setattr(harness, "run_grid", lambda *a, **k: {"points": [point]})
    monkeypatch.setattr(harness, "plot_results", lambda *a, **k: True)
    assert harness.main(["--quick", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "one right-padded batch through the stock model" in out and "A measured ratio can pass the ideal" in out
    assert "1 of 1 points measured above the ideal" in out


# ---------------------------------------------------------------------------- answering at once
_HEAVY_IMPORTS = """
import runpy, sys
sys.argv = ["flexgroup", *{argv!r}]
try:
    runpy.run_module("flexgroup", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print("heavy:", ",".join(m for m in ("torch", "transformers") if m in sys.modules), file=sys.stderr)
"""


def _heavy_imports(argv: list[str]) -> tuple[set[str], str]:
    """Which of torch and transformers ``python -m flexgroup ARGV`` imported, and its stdout."""
    proc = subprocess.run([sys.executable, "-c", _HEAVY_IMPORTS.format(argv=argv)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("heavy:"), proc.stderr[-2000:]
    return set(filter(None, last[len("heavy:"):].strip().split(","))), proc.stdout


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["demo", "--help"], ["verify", "--help"],
                                  ["verify", "--arch", "no-such-arch"], ["verify", "--model", "./no-such-dir"],
                                  ["demo", "--frobnicate"], ["bench", "--help"],
                                  ["bench", "--grid", "no-such-grid"],
                                  *[["bench", w, "--help"] for w in ("trees", "hybrids", "scoring", "stream")]])
def test_help_version_and_usage_errors_answer_without_importing_torch_or_transformers(argv):
    heavy, out = _heavy_imports(argv)
    assert heavy == set(), f"flexgroup {' '.join(argv)} imported {heavy} (seconds) before answering"
    if argv == ["--version"]:
        assert re.match(r"flexgroup \S+ \(torch \S+, transformers \S+\)$", out.strip()), out


def test_the_import_check_sees_torch_when_a_command_needs_it():
    """The control: a command that gets past argument parsing imports torch, and the check above notices."""
    assert "torch" in _heavy_imports(["demo", "--device", "cuda"])[0]


def test_bench_help_lists_every_workload_and_the_package_still_offers_the_harness_names():
    """``import flexgroup.bench`` is torch-free; its harness and measure names (``build_model``, ``run_grid``,
    ``time_interleaved`` ...) load on use."""
    import flexgroup.bench as bench
    from flexgroup.bench import harness, measure, options, stream_workloads

    assert set(bench.WORKLOADS) == set(options.WORKLOADS) == {"trees", "hybrids", "scoring", "stream", "dta",
                                                                 "longrow"}
    assert bench.run_grid is harness.run_grid and bench.time_interleaved is measure.time_interleaved
    assert harness.GRIDS is options.GRIDS and harness.add_arguments is options.add_arguments
    assert stream_workloads.MODELS == options.STREAM_MODELS and stream_workloads.WORKLOADS == options.STREAM_WORKLOADS
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        bench.no_such_name


def test_the_clis_literal_choices_equal_their_sources():
    """cli.py copies these names so that parsing needs no torch; a new architecture, backend or calibration
    must be added there too."""
    from flexgroup import cli
    from flexgroup.models.zoo import ARCHS, SIZES
    from flexgroup.verification.calibration import CALIBRATIONS
    from flexgroup.kernels import BACKEND_NAMES

    assert cli.ARCH_NAMES == ARCHS
    assert cli.BACKEND_NAMES == BACKEND_NAMES
    assert cli.CALIBRATION_NAMES == CALIBRATIONS
    assert all(isinstance(getattr(torch, d), torch.dtype) for d in cli.DTYPE_NAMES)
    assert {"demo", "tiny"} <= set(SIZES)


def test_import_flexgroup_keeps_its_public_names_and_submodules():
    """``import flexgroup`` imports nothing heavy (the --help test above shows it); every name still resolves."""
    import flexgroup

    namespace: dict = {}
    exec("from flexgroup import *", namespace)  # noqa: S102 -- the star import users write
    assert set(flexgroup.__all__) <= set(namespace) and all(namespace[n] is not None for n in flexgroup.__all__)
    assert flexgroup.Layout.group(prefix_len=3, response_lens=[1]).num_tokens == 4
    assert callable(flexgroup.layout.masks.mask_mod) and flexgroup.kernels.BACKEND_NAMES and flexgroup.patterns.sliding_window
    assert "verify" in dir(flexgroup) and flexgroup.verify is importlib.import_module("flexgroup.verification.equivalence").verify
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        flexgroup.no_such_name


def _bench_parsers(monkeypatch) -> dict:
    """The argument parser of ``flexgroup bench`` and of each workload, caught before anything runs."""
    import argparse

    from flexgroup.bench import harness

    class Caught(Exception):
        pass

    parsers = {}

    def catch(self, *args, **kwargs):
        parsers[self.prog] = self
        raise Caught

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    for argv in [[]] + [[w] for w in harness.WORKLOADS]:
        with pytest.raises(Caught):
            harness.main(argv)
    return parsers


def test_every_option_of_every_command_has_help_and_no_help_shows_markup(monkeypatch):
    from flexgroup.cli import build_parser

    parsers = _bench_parsers(monkeypatch)
    assert set(parsers) == {"flexgroup bench", "flexgroup bench trees", "flexgroup bench hybrids",
                            "flexgroup bench scoring", "flexgroup bench stream", "flexgroup bench dta",
                            "flexgroup bench longrow"}, set(parsers)
    top = build_parser()
    parsers.update({"flexgroup": top, **{f"flexgroup {n}": p for n, p in top._subparsers._group_actions[0].choices.items()
                                         if n != "bench"}})
    for prog, parser in parsers.items():
        bare = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
        assert not bare, f"{prog}: options without help: {bare}"
        text = parser.format_help()
        for markup in ("``", ":mod:", ":func:", ":class:"):
            assert markup not in text, f"{prog} --help shows {markup!r}: {text}"
