"""Every old import path of the layer restructure (issue 33) still works: ``flexgroup/_moved.py``'s MOVED table.

Each old dotted path imports, warns once with a ``FutureWarning`` naming the new path, and is the *same*
module object as the new one (so classes, ``isinstance`` and pickles are unchanged). The two old modules
whose name is now a package (``flexgroup.layout``, ``flexgroup.stream``) re-export their names.
"""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from flexgroup._moved import MOVED, SHADOWED

ROOT = Path(__file__).resolve().parents[2]


def _forget(name: str) -> None:
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    if parent in sys.modules and child in vars(sys.modules[parent]):  # not getattr: flexgroup's would import it
        delattr(sys.modules[parent], child)  # else `import a.b` may find the attribute bound earlier


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_path_imports_warns_and_is_the_new_module(old):
    new = importlib.import_module(MOVED[old])
    _forget(old)
    with pytest.warns(FutureWarning, match=rf"{old} moved to {MOVED[old]}") as rec:
        mod = importlib.import_module(old)
    assert mod is new
    assert sys.modules[old] is new
    assert new.__name__ == MOVED[old] and new.__spec__.name == MOVED[old]  # the new module's identity is untouched
    assert len([w for w in rec if issubclass(w.category, FutureWarning)]) == 1
    assert rec[0].filename == __file__ or "importlib" not in rec[0].filename  # points at the importer


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_new_path_exists_as_a_file(old):
    new = MOVED[old]
    path = ROOT.joinpath(*new.split("."))
    assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), new
    assert not ROOT.joinpath(*old.split(".")).with_suffix(".py").exists(), f"{old} is both moved and still a file"


def test_from_import_and_attribute_spellings():
    for name in ("flexgroup.stream_plan", "flexgroup.equivalence", "flexgroup.models"):
        _forget(name)
    with pytest.warns(FutureWarning, match="flexgroup.stream.plan"):
        from flexgroup.stream_plan import plan_stream
    from flexgroup.stream.plan import plan_stream as new_plan_stream
    assert plan_stream is new_plan_stream
    with pytest.warns(FutureWarning, match="flexgroup.verification.verify"):
        import flexgroup.equivalence as eq
    import flexgroup
    assert eq.verify is flexgroup.verify
    with pytest.warns(FutureWarning, match="flexgroup.bench.zoo"):
        from flexgroup.models import build_model
    from flexgroup.bench.zoo import build_model as new_build_model
    assert build_model is new_build_model


def test_isinstance_and_pickle_across_old_and_new_paths():
    from flexgroup.verification.report import Difference as New

    _forget("flexgroup.verify_report")
    with pytest.warns(FutureWarning):
        from flexgroup.verify_report import Difference as Old
    assert Old is New
    d = New(0.0, 0.0, 0.0, "x") if _fields(New) == 4 else None
    if d is not None:
        assert isinstance(pickle.loads(pickle.dumps(d)), Old)
    # a pickle written before the move names the old module: it still loads, as the new class
    from flexgroup.layout import Layout

    lay = Layout.group(prefix_len=3, response_lens=[2, 1])
    blob = pickle.dumps(lay, protocol=0).replace(b"cflexgroup.layout.layout\n", b"cflexgroup.layout\n")  # text opcodes
    assert b"cflexgroup.layout\nLayout" in blob  # the pickle names the old module
    back = pickle.loads(blob)
    assert isinstance(back, Layout) and back == lay
    from flexgroup.data.batch import GroupedBatch
    import torch

    batch = GroupedBatch.from_sequences([torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])])
    old_blob = pickle.dumps(batch, protocol=0).replace(b"cflexgroup.data.batch\n", b"cflexgroup.batch\n")
    assert b"cflexgroup.batch\n" in old_blob
    _forget("flexgroup.batch")
    with pytest.warns(FutureWarning, match="flexgroup.data.batch"):
        again = pickle.loads(old_blob)
    assert type(again) is GroupedBatch and again.layout == batch.layout


def _fields(cls) -> int:
    import dataclasses

    return len(dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else -1


def test_the_shadowed_modules_are_packages_that_reexport_their_names():
    import flexgroup.layout as layout_pkg
    import flexgroup.layout.layout as layout_mod
    import flexgroup.stream as stream_pkg
    import flexgroup.stream.front as front

    assert set(SHADOWED) == {"flexgroup.layout", "flexgroup.stream"}
    for name in layout_mod.__all__:
        assert getattr(layout_pkg, name) is getattr(layout_mod, name)
    for name in front.__all__:
        assert getattr(stream_pkg, name) is getattr(front, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from flexgroup.layout import Cost, Layout  # noqa: F401
        from flexgroup.stream import stream_backward, stream_logprobs  # noqa: F401


def test_a_path_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("flexgroup.no_such_module")


def test_the_new_paths_import_without_warnings_in_a_fresh_interpreter():
    # a fresh process: every new module imports with FutureWarning as an error (nothing inside the package
    # still uses an old path; a planted old import would fail here -- see the broken variant below)
    mods = sorted(set(MOVED.values()))
    code = "import importlib, warnings\nwarnings.simplefilter('error', FutureWarning)\n" + "".join(
        f"importlib.import_module({m!r})\n" for m in mods if m != "flexgroup.bench.zoo") + "import flexgroup.bench.zoo\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    broken = code + "import flexgroup.equivalence\n"
    r = subprocess.run([sys.executable, "-c", broken], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "FutureWarning" in r.stderr
