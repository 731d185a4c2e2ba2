"""The ``flexgroup`` command: demo and verify end to end (tiny sizes), argument errors, the bench hook."""

import importlib
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from flexgroup.cli import main

TINY_DEMO = ["demo", "--size", "tiny", "--prefix-len", "24", "--group-size", "3", "--response-len", "6"]
SUMMARY = re.compile(r"^equivalent: (yes|no) \(max \|dlogp\| = \S+, max rel \|dgrad\| = \S+\); "
                     r"speedup: \d+\.\d\dx \(ideal \d+\.\d\dx\)$", re.M)




def test_demo_prints_the_table_and_the_summary_line_and_exits_zero(capsys):
    assert main(TINY_DEMO) == 0
    out = capsys.readouterr().out
    for row in ("tokens processed", "attention pairs", "time / step", "peak memory", "loss (step 1)",
                "max |d log-prob|", "max rel |d grad|"):
        assert row in out
    assert "n/a (cpu)" in out  # no fake CPU memory number
    summary = SUMMARY.search(out)
    assert summary and summary.group(1) == "yes", out


def test_demo_counts_tokens_and_pairs_of_the_layout(capsys):
    # P = 24, G = 3, R = 6: lengths ceil(6 * (3 + i + 1) / 6) = 4, 5, 6
    # baseline tokens 28 + 29 + 30 = 87 (+3 pad to 30 each), grouped 24 + 15 = 39
    # pairs: baseline (28*29 + 29*30 + 30*31) / 2 = 1306; grouped 24*25/2 + 24*15 + (10 + 15 + 21) = 706
    main(TINY_DEMO)
    out = capsys.readouterr().out
    assert re.search(r"tokens processed\s+87 \(\+3 pad\)\s+39", out), out
    assert re.search(r"attention pairs\s+1,306\s+706", out), out
    assert "3 responses of 4..6 tokens" in out


def test_demo_with_steps_shows_both_losses_staying_together(capsys):
    assert main(TINY_DEMO + ["--steps", "3", "--groups", "2"]) == 0
    out = capsys.readouterr().out
    steps = re.findall(r"step\s+(\d)/3 \[[#.]+\] loss baseline ([-+.\d]+)\s+flexgroup ([-+.\d]+)", out)
    assert [s[0] for s in steps] == ["1", "2", "3"]
    assert all(abs(float(b) - float(g)) < 1e-4 for _, b, g in steps)
    assert float(steps[0][1]) != float(steps[2][1])  # the optimizer moved the policy
    assert "loss (step 3)" in out


def test_demo_exits_nonzero_when_the_runs_differ(capsys, causal_over_packed_row):
    assert main(TINY_DEMO) == 1
    assert SUMMARY.search(capsys.readouterr().out).group(1) == "no"


def test_demo_runs_other_architectures_and_dtypes(capsys):
    assert main(TINY_DEMO + ["--arch", "gemma2", "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert "(eager)" in out and "float64" in out


def test_verify_command_passes_and_prints_the_differences(capsys):
    assert main(["verify", "--arch", "qwen3", "--response-lens", "3,1,8", "--groups", "2"]) == 0
    out = capsys.readouterr().out
    assert "logprobs" in out and "grads" in out and "equivalent: yes" in out


def test_verify_command_takes_a_layout_of_groups_of_different_shapes(capsys):
    assert main(["verify", "--arch", "mistral", "--layout", "30:5,12,1;3:7,2;9:1"]) == 0
    out = capsys.readouterr().out
    assert "layout: prompt 30 + responses 5,12,1; prompt 3 + responses 7,2; prompt 9 + responses 1" in out
    assert "6 responses: 70 tokens packed vs 133 one by one" in out  # 30+18 + 3+9 + 9+1; 35+42+31+10+5+10


def test_verify_command_exits_one_beyond_tolerance(capsys):
    assert main(["verify", "--arch", "llama", "--tol-grads", "0"]) == 1
    assert "equivalent: no" in capsys.readouterr().out


def test_verify_command_on_a_local_model_directory(tmp_path, capsys):
    from flexgroup.models import build_model

    build_model("olmo2").save_pretrained(tmp_path)
    assert main(["verify", "--model", str(tmp_path), "--prefix-len", "10"]) == 0
    assert "olmo2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--prefix-len", "0"], "--prefix-len: expected a positive integer, got 0"),
        (["demo", "--group-size", "two"], "--group-size: expected a positive integer, got 'two'"),
        (["demo", "--arch", "gpt9"], "--arch: invalid choice: 'gpt9'"),
        (["demo", "--dtype", "float8"], "--dtype: invalid choice: 'float8'"),
        (["demo", "--threads", "0"], "--threads: expected a positive integer, got 0"),
        (["demo", "--beta", "-1"], "--beta: expected a number >= 0, got -1"),
        (["demo", "--backend", "flex"], "--backend flex cannot train on cpu"),
        (["verify"], "one of the arguments --arch --model is required"),
        (["verify", "--arch", "llama", "--model", "x"], "not allowed with argument"),
        (["verify", "--arch", "llama", "--response-lens", "5,x"],
         "--response-lens: expected a positive integer, got 'x'"),
        (["verify", "--arch", "llama", "--layout", "30;3:7"], "--layout: expected groups like 24:5,12,1;6:3,3"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required"),
    ],
)
def test_argument_errors_are_clear(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_cuda_without_cuda_is_an_argument_error(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--device", "cuda"])
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err


def test_bench_hook_reports_a_missing_module(monkeypatch, capsys):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(importlib, "import_module", missing)
    assert main(["bench", "--quick"]) == 2
    assert "flexgroup bench: not available" in capsys.readouterr().err


def test_bench_hook_passes_its_arguments_through(monkeypatch):
    seen = []
    monkeypatch.setitem(sys.modules, "flexgroup.bench", types.SimpleNamespace(main=lambda argv: seen.append(argv) or 0))
    assert main(["bench", "--quick", "--out", "x.json"]) == 0
    assert seen == [["--quick", "--out", "x.json"]]


def test_python_dash_m_flexgroup_demo_runs_in_a_subprocess():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "flexgroup", "demo", "--prefix-len", "64", "--size", "tiny",
                           "--group-size", "2", "--response-len", "4"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert SUMMARY.search(proc.stdout).group(1) == "yes"
