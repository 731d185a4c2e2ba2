"""tools/rewrite_imports.py: old flexgroup paths -> new ones, in code, strings and docs; idempotent; --check.

Cases on a copy of the package (so relative imports resolve as in the real tree), then the repository
itself: nothing in it still names an old path.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("rewrite_imports", ROOT / "tools" / "rewrite_imports.py")
rw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rw)

@pytest.fixture()
def tree(tmp_path):
    shutil.copytree(ROOT / "flexgroup", tmp_path / "flexgroup", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _run(tree: Path, path: str, text: str, moved=None, paths=None) -> str:
    f = tree / path
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    r = rw.Rewriter({**rw.MOVED, **(moved or {})}, {**rw.PATHS, **(paths or {})}, root=tree)
    r.rewrite(f)
    once = f.read_text()
    assert not r.rewrite(f), "a second run changed the file again"
    assert not r.leftovers(f)
    return once


def test_relative_imports_of_a_moved_module(tree):
    old = ("from .stream_plan import plan_stream\nfrom . import stream_shard\nfrom .layout import Layout\n"
           "from .checks import token_ids\nfrom .patches import patch\n\n\ndef f():\n    from .oracle import own_copy\n")
    new = ("from .plan import plan_stream\nfrom . import shard as stream_shard\nfrom ..layout import Layout\n"
           "from ..layout.checks import token_ids\nfrom ..patches import patch\n\n\ndef f():\n"
           "    from ..reference.oracle import own_copy\n")
    assert _run(tree, "flexgroup/stream/front.py", old) == new


def test_a_module_that_did_not_move(tree):
    old = "from ..masks import flex_inputs\nfrom ..patterns import Pattern\nfrom .base import Backend\n"
    new = "from ..layout.masks import flex_inputs\nfrom ..layout.patterns import Pattern\nfrom .base import Backend\n"
    assert _run(tree, "flexgroup/kernels/flex.py", old) == new


def test_absolute_imports_strings_attributes_and_paths(tree):
    old = ("import flexgroup\nfrom flexgroup.equivalence import verify\nfrom flexgroup import padded\n"
           "from flexgroup.stream import _check_budget\nfrom flexgroup.stream import stream_backward\n"
           "import flexgroup.calibration as calibration\nx = flexgroup.patterns.causal()\n"
           "mock.patch('flexgroup.batch.GroupedBatch.x')\nm = \"flexgroup.stream._Streamer\"\n"
           "# see tests/front/test_verl.py and flexgroup/equivalence.py, flexgroup.stream_plan\n"
           "from tests.models.test_vl import make_vl\n")
    new = ("import flexgroup\nfrom flexgroup.verification.verify import verify\nfrom flexgroup.data import padded\n"
           "from flexgroup.stream.front import _check_budget\nfrom flexgroup.stream import stream_backward\n"
           "import flexgroup.verification.calibration as calibration\nx = flexgroup.patterns.causal()\n"
           "mock.patch('flexgroup.data.batch.GroupedBatch.x')\nm = \"flexgroup.stream.front._Streamer\"\n"
           "# see tests/integrations/test_verl.py and flexgroup/verification/verify.py, flexgroup.stream.plan\n"
           "from tests.patches.test_vl import make_vl\n")
    assert _run(tree, "tests/x/test_a.py", old) == new


def test_a_mixed_from_import_is_split(tree):
    old = "def f():\n    from flexgroup import Layout, masks, patterns, grpo as g\n"
    new = ("def f():\n    from flexgroup import Layout, patterns\n    from flexgroup.layout import masks\n"
           "    from flexgroup.train import grpo as g\n")
    assert _run(tree, "tests/x/test_b.py", old) == new


def test_docs(tree):
    old = ("`flexgroup.grpo.policy_loss`, `flexgroup/stream.py`, `tests/front/test_verl*.py`, "
           "`flexgroup.patterns.causal()`\n```python\nfrom flexgroup.scoring import score\n```\n"
           "a table naming flexgroup.batch on purpose <!-- old-path: keep -->\n")
    new = ("`flexgroup.train.grpo.policy_loss`, `flexgroup/stream/front.py`, `tests/integrations/test_verl*.py`, "
           "`flexgroup.patterns.causal()`\n```python\nfrom flexgroup.train.scoring import score\n```\n"
           "a table naming flexgroup.batch on purpose <!-- old-path: keep -->\n")
    assert _run(tree, "docs/x.md", old) == new


def test_extra_mappings_for_another_branchs_new_module(tree):
    # a branch added flexgroup/stream_foo.py (old layout); after `git mv` to stream/foo.py:
    moved, paths = {"flexgroup.stream_foo": "flexgroup.stream.foo"}, {"tests/front/test_foo.py": "tests/stream/test_foo.py"}
    src = _run(tree, "flexgroup/stream/foo.py", "from .stream_plan import plan_stream\nfrom .batch import GroupedBatch\n",
               moved, paths)
    assert src == "from .plan import plan_stream\nfrom ..data.batch import GroupedBatch\n"
    test = _run(tree, "tests/stream/test_foo.py", "from flexgroup.stream_foo import y  # tests/front/test_foo.py\n",
                moved, paths)
    assert test == "from flexgroup.stream.foo import y  # tests/stream/test_foo.py\n"


def test_check_exits_1_on_an_old_path_and_0_after(tmp_path, capsys):
    f = tmp_path / "a.py"
    f.write_text("from flexgroup.oracle import own_copy\n")
    assert rw.main(["--check", str(f)]) == 1
    assert "flexgroup.oracle" in capsys.readouterr().out
    assert rw.main([str(f)]) == 0
    assert rw.main(["--check", str(f)]) == 0
    assert f.read_text() == "from flexgroup.reference.oracle import own_copy\n"
    g = tmp_path / "b.py"
    g.write_text("import flexgroup.new_thing\n")
    assert rw.main(["--check", "--map=flexgroup.new_thing=flexgroup.data.new_thing", str(g)]) == 1
    with pytest.raises(SystemExit):
        rw.main(["--map=nonsense", str(g)])


def test_imports_only_leaves_prose(tree):
    f = tree / "tests" / "t.py"
    f.parent.mkdir(parents=True)
    f.write_text('"""about flexgroup.batch"""\nfrom flexgroup.batch import GroupedBatch\n')
    rw.Rewriter(rw.MOVED, rw.PATHS, root=tree, imports_only=True).rewrite(f)
    assert f.read_text() == '"""about flexgroup.batch"""\nfrom flexgroup.data.batch import GroupedBatch\n'


def test_the_repository_uses_no_old_path():
    r = rw.Rewriter(rw.MOVED, rw.PATHS)
    dirs = ["flexgroup", "tests", "docs", "README.md", "benchmarks", "examples", ".ci", "tox.ini", "pyproject.toml"]
    files = [f for f in rw._files([str(ROOT / d) for d in dirs]) if f.resolve() not in rw.SKIP]
    assert len(files) > 200
    bad = {}
    for f in files:
        left = r.leftovers(f)
        if left:
            bad[str(f.relative_to(ROOT))] = left
    assert not bad, f"run tools/rewrite_imports.py on these: {bad}"
