"""`flexgroup bench stream --quick` runs end to end and records what the P10 table reads."""

import json

import pytest

from flexgroup.bench import stream


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
