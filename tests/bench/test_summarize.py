"""benchmarks/summarize.py reads every kind of result file that benchmarks/results/ holds."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "summarize.py"


def test_every_committed_result_file_gets_a_table():
    files = sorted(str(f) for f in (ROOT / "benchmarks" / "results").glob("*.json"))
    out = subprocess.run([sys.executable, str(SCRIPT), *files], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for f in files:
        assert f"{f}:" in out.stdout, f"no table for {f}"


def test_a_workload_record_reports_its_ratios_against_each_sequence_alone(tmp_path):
    record = {"ideal": {"trie": 3.0}, "results": {
        "padded": {"median_cpu_s": 8.0, "speedup": 1.0, "speedup_cpu": 1.0},
        "alone": {"median_cpu_s": 4.0, "speedup": 2.0, "speedup_cpu": 2.0},
        "trie": {"median_cpu_s": 2.0, "speedup": 4.0, "speedup_cpu": 4.0}}}
    path = tmp_path / "w.json"
    path.write_text(json.dumps(record))
    out = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("| trie |"))
    # 4x against the padded batch, 2x against each alone, which is 0.67 of the ideal 3x
    assert "| 4.00x | 2.00x | 3.00x | 0.67 |" in row, row


def test_an_unknown_kind_is_shown_as_its_values(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"a": {"b": 1.5}, "c": "x"}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "| a.b | 1.5 |" in out.stdout and "| c | x |" in out.stdout
