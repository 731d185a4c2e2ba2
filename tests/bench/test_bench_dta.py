"""`flexgroup bench dta`: AReaL-DTA's tree shape, and the quick run end to end (issue 39, P11)."""

import json

import pytest

from flexgroup import GroupedBatch
from flexgroup.bench import dta


def test_the_default_tree_reads_14008_scored_tokens_from_4008_distinct_logit_rows():
    seqs = dta.dta_tree(**dta.SIZES, vocab=dta.MODEL["vocab"])
    batch = GroupedBatch.from_sequences(seqs)
    assert len(seqs) == 17 and [s.numel() for s in seqs[:2]] == [425, 475]
    assert int(batch.response_mask.sum()) == 14008 and batch.logit_rows.numel() == 4008
    assert batch.num_tokens == 250 + 16 * 50 + 17 * (125 + 50)   # the responses once, each thinking once


@pytest.mark.slow
def test_bench_dta_quick_checks_the_trie_against_each_trajectory_alone_and_records_the_readout(tmp_path, capsys):
    out = tmp_path / "dta.json"
    assert dta.main(["--quick", "--rounds", "1", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec["results"]) == {"alone", "trie"}
    assert all(r["max_abs_err"] <= 1e-3 and r["median_cpu_s"] > 0 for r in rec["results"].values())
    assert rec["readout"]["saved_bytes"] > 0 and rec["ideal"]["trie"] > 1
    assert "| trie |" in capsys.readouterr().out
