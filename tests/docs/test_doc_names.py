"""Every public name the README and docs/ mention exists: a renamed or never-written function in the
docs fails here (``flexgroup.x.y``, ``GroupedBatch.x``, ``Layout.x``, ``from flexgroup... import a, b``)."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED = re.compile(r"(?<![\w/.-])(flexgroup(?:\.[A-Za-z_]\w*)+)")
CLASS_ATTR = re.compile(r"(?<![\w.])((?:Multimodal)?GroupedBatch|Layout)\.([A-Za-z_]\w*)")
FROM_IMPORT = re.compile(r"^\s*from (flexgroup[\w.]*) import ([\w, ()]+)", re.M)


def _resolve(dotted: str):
    """The object named ``dotted``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    if parts[:2] in (["flexgroup", "patterns"], ["flexgroup", "score_mods"]):  # public attributes of flexgroup
        import flexgroup

        obj = flexgroup
        for attr in parts[1:]:
            obj = getattr(obj, attr)
        return obj
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("flexgroup"):
                pytest.skip(f"{dotted} needs {e.name}, which is not installed")
            continue
        except ImportError as e:  # an integration whose optional dependency is missing
            pytest.skip(f"{dotted}: {e}")
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def _names() -> list[tuple[str, str]]:
    out = set()
    for doc in DOCS:
        text = doc.read_text()
        rel = str(doc.relative_to(ROOT))
        for m in DOTTED.finditer(text):
            name = m.group(1).rstrip(".")
            if name.endswith((".py", ".md")):
                continue
            out.add((rel, name))
        for m in CLASS_ATTR.finditer(text):
            cls = "flexgroup.MultimodalGroupedBatch" if m.group(1).startswith("Multimodal") else f"flexgroup.{m.group(1)}"
            out.add((rel, f"{cls}.{m.group(2)}"))
        for m in FROM_IMPORT.finditer(text):
            for n in re.split(r"[,\s()]+", m.group(2)):
                if n and n != "as":
                    out.add((rel, f"{m.group(1)}.{n}"))
    return sorted(out)


@pytest.mark.parametrize("doc,name", _names(), ids=[f"{d}:{n}" for d, n in _names()])
def test_a_name_in_the_docs_exists(doc, name):
    try:
        _resolve(name)
    except (AttributeError, ModuleNotFoundError) as e:
        pytest.fail(f"{doc} names {name}, which does not exist ({e})")


def test_the_checker_finds_a_name_that_does_not_exist():
    with pytest.raises(AttributeError):
        _resolve("flexgroup.GroupedBatch.micro_batches_that_never_existed")


# files that name missing test paths on purpose: this one
_NAMES_OLD_PATHS = {pathlib.Path(__file__).name}
TEST_PATH = re.compile(r"(?<![\w/.-])(tests/[\w/]+\.py)")


def _test_paths() -> list[tuple[str, str]]:
    """(file, tests/... path) of every test file named in the docs, the examples, the package and CI."""
    files = [*DOCS, *sorted((ROOT / "examples").glob("*.py")), *sorted((ROOT / "flexgroup").rglob("*.py")),
             *sorted(p for p in (ROOT / "tests").rglob("*.py") if p.name not in _NAMES_OLD_PATHS),
             *sorted(p for p in (ROOT / ".ci").glob("*") if p.is_file())]
    return sorted({(str(f.relative_to(ROOT)), m.group(1)) for f in files for m in TEST_PATH.finditer(f.read_text())})


@pytest.mark.parametrize("where,path", _test_paths(), ids=[f"{w}:{p}" for w, p in _test_paths()])
def test_a_test_file_named_anywhere_exists(where, path):
    assert (ROOT / path).is_file(), f"{where} names {path}, which does not exist (moved? name its new path)"


def test_the_test_path_check_finds_a_moved_file():
    assert TEST_PATH.findall("see tests/test_examples.py and tests/cli/test_cli.py") == [
        "tests/test_examples.py", "tests/cli/test_cli.py"]
    assert not (ROOT / "tests/test_examples.py").is_file()
