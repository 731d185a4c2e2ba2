"""`flexgroup bench stream --quick` runs end to end and records what the P10 table reads."""

import json

import pytest

from flexgroup.bench import stream
from flexgroup.models.zoo import unavailable


@pytest.mark.slow
def test_bench_stream_quick_checks_every_contender_and_records_memory_and_time(tmp_path, capsys):
    out = tmp_path / "stream.json"
    assert stream.main(["--quick", "--rounds", "1", "--no-rss", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    res = rec["results"]
    assert set(res) == {"alone", "packed", "stream-256", "stream-1024"}
    assert all(r["max_abs_err"] <= 1e-3 and r["median_cpu_s"] > 0 for r in res.values())
    # memory is recorded for the P10 table (the claim itself is measured in benchmarks/, not asserted here:
    # it depends on the torch version's saved tensors, e.g. torch 2.6's CPU sdpa)
    assert all(r["held_peak_bytes"] > 0 for r in res.values())
    assert "| stream-256 |" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_stream_quick_tree_on_the_hybrid_checks_every_contender_against_each_sequence_alone(tmp_path):
    if unavailable("qwen3_5_text"):
        pytest.skip(unavailable("qwen3_5_text"))
    out = tmp_path / "stream-tree-hybrid.json"
    assert stream.main(["--quick", "--workload", "tree", "--model", "hybrid", "--rounds", "1", "--no-rss",
                        "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["model"]["model_type"] == "qwen3_5_text" and rec["workload"] == "tree"
    # the tree is larger than both quick budgets, so every streamed contender really streams
    assert rec["packed_tokens"] > max(rec["budgets"]) and rec["alone_tokens"] > rec["packed_tokens"]
    assert all(r["max_abs_err"] <= 1e-3 and r["median_cpu_s"] > 0 for r in rec["results"].values())
    assert rec["ideal"]["packed"] > 1.0 and rec["ideal"]["alone"] == 1.0


def test_bench_stream_refuses_to_time_a_contender_whose_logprobs_differ_from_alone(monkeypatch):
    # broken variant: a contender that shifts every log-prob by 1e-2 must stop the benchmark before any timing
    real = stream.Packed.logprobs
    monkeypatch.setattr(stream.Packed, "logprobs", lambda self: real(self) + 1e-2)
    with pytest.raises(AssertionError, match="packed: log-probs differ from alone"):
        stream.main(["--quick", "--rounds", "1", "--no-rss"])
