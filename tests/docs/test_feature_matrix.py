"""docs/architecture.md's "Features combined" table: each of the 21 pairs of the seven features once,
each either exact or refused, and every ``tests/...py::test_name`` it cites is a test that exists."""

from __future__ import annotations

import ast
import itertools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
FEATURES = ["streaming", "sequence parallel", "vision-language", "hybrid", "trees", "LoRA", "checkpointing"]
CITE = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")


def _rows(text: str) -> dict[str, tuple[str, str]]:
    """pair -> (status, evidence) of the table under '## Features combined'."""
    section = text.split("## Features combined", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and " x " in cells[0]:
            assert cells[0] not in rows, f"pair listed twice: {cells[0]}"
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def _defined_tests(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _problems(text: str) -> list[str]:
    rows, out = _rows(text), []
    want = {f"{a} x {b}" for a, b in itertools.combinations(FEATURES, 2)}
    out += [f"missing pair: {p}" for p in sorted(want - set(rows))]
    out += [f"unknown pair: {p}" for p in sorted(set(rows) - want)]
    for pair, (status, evidence) in rows.items():
        if not status.startswith(("exact, tested", "refused")):
            out.append(f"{pair}: status {status!r} is neither 'exact, tested' nor 'refused ...'")
        if status.startswith("refused") and "because" not in status:
            out.append(f"{pair}: a refusal without its reason ('because ...')")
        cites = CITE.findall(evidence)
        if not cites:
            out.append(f"{pair}: cites no test (`tests/....py::test_name`)")
        for file, name in cites:
            path = ROOT / file
            if not path.is_file():
                out.append(f"{pair}: {file} does not exist")
            elif name not in _defined_tests(path):
                out.append(f"{pair}: {file} defines no {name}")
    return out


def test_every_pair_is_exact_or_refused_and_cites_tests_that_exist():
    problems = _problems((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_missing_pair_a_missing_file_and_a_missing_test():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    gone = "tests/patches/test_gone" + ".py"   # split: test_doc_names checks every whole tests/ path it sees
    broken = (text.replace("| trees x LoRA |", "| trees x nothing |")
                  .replace("tests/patches/test_hybrids.py::test_three_level_tree", gone + "::test_x")
                  .replace("::test_lora_adapter_streams_exactly", "::test_never_written"))
    problems = "\n".join(_problems(broken))
    assert "missing pair: trees x LoRA" in problems and "unknown pair: trees x nothing" in problems
    assert f"{gone} does not exist" in problems
    assert "defines no test_never_written" in problems
