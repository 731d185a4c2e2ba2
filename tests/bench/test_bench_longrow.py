"""`flexgroup bench longrow`: block-mask build time against the row length, and the trie (issue 39, P12)."""

import json

from flexgroup.bench import longrow


def test_the_rows_are_packed_groups_of_8192_tokens():
    lay = longrow.row(65_536)
    assert lay.num_tokens == 65_536 and len(lay.roots) == 8 and lay.num_segments == 8 * 9


def test_bench_longrow_quick_records_every_size_pattern_exponent_and_the_trie(tmp_path, capsys):
    out = tmp_path / "longrow.json"
    assert longrow.main(["--quick", "--rounds", "1", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    sizes = longrow.QUICK_SIZES
    assert rec["sizes"] == sizes and set(rec["mask"]) == set(longrow.PATTERNS)
    for per in rec["mask"].values():
        assert set(per) == {str(n) for n in sizes} and all(t["cpu_ms"] > 0 and t["wall_ms"] > 0 for t in per.values())
    assert set(rec["exponent"]["causal"]) == {f"{a}->{2 * a}" for a in sizes[:-1]}
    # 4 groups: the 4,096-token prompt once and 8 distinct halves of 4,096 per group
    assert rec["trie"]["nodes"] == 4 * (4096 + 8 * 4096) and rec["trie"]["input_tokens"] == 4 * 8 * 8192
    assert "| 65,536 | 512 |" in capsys.readouterr().out
