"""The package's import graph: imports point down the layers of docs/architecture.md, with no cycles.

Every import is counted -- module level and inside functions -- by reading the source (``ast``), so a
lazy import cannot hide an upward edge. There is no whitelist: no module imports from a layer above its
own (the root package ``flexgroup`` included: a module below it never imports it), the graph has no cycle,
no module imports another subpackage's private (``_``) module or name, every module lives in a layer's
folder (a new top-level module or subpackage must be given a layer here and in docs/architecture.md), and
``flexgroup/`` holds at most 8 top-level modules besides its subpackages. docs/architecture.md's layer
table is checked against :data:`LAYERS`. Each rule is also shown to fail on a planted violation.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# the layers, bottom (0) to top; a module's layer is its package's (longest matching prefix);
# "flexgroup" itself (the package root, flexgroup/__init__.py) matches only exactly
LAYERS = {
    "flexgroup.submodules": 0,                               # lazy submodule loading (imports nothing of flexgroup)
    "flexgroup.caches": 0,                                   # the cache registry: names caches by string, imports nothing
    "flexgroup.layout": 1, "flexgroup.reference": 1,         # the mask description; what grouped must equal
    "flexgroup.kernels": 2, "flexgroup.data": 2,             # attention over a Layout; sequences <-> the row
    "flexgroup.patches": 3,                                  # transformers models
    "flexgroup.stream": 4, "flexgroup.verification": 4, "flexgroup.train": 4,   # the entry points
    "flexgroup.models": 4,                                   # the tiny-model zoo (imported by bench and the CLI only)
    "flexgroup": 5,                                          # the public surface (lazy re-exports)
    "flexgroup.integrations": 6,                             # TRL, lm-eval, verl (optional deps)
    "flexgroup.bench": 7,                                    # benchmarks, demo, doctor
    "flexgroup.cli": 8,                                      # the flexgroup command
    "flexgroup.__main__": 9,                                 # python -m flexgroup
}
NO_TRANSFORMERS_BELOW = LAYERS["flexgroup.patches"]  # layers under the patches layer never import transformers
MAX_TOP_LEVEL = 8


def _modules(base: Path = ROOT / "flexgroup") -> dict[str, Path]:
    mods = {}
    for f in base.rglob("*.py"):
        rel = f.relative_to(base).with_suffix("")
        parts = ["flexgroup", *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


MODULES = _modules()


def layer(mod: str, layers: dict[str, int] = LAYERS) -> int:
    if mod == "flexgroup":
        return layers["flexgroup"]
    best = max((p for p in layers if p != "flexgroup" and (mod == p or mod.startswith(p + "."))), key=len, default=None)
    if best is None:
        raise AssertionError(f"{mod} lives outside every layer's folder: move it into one (flexgroup/layout/, data/, ...) "
                             "or give it a layer in LAYERS (tests/package/test_architecture.py) and docs/architecture.md")
    return layers[best]


def _named(mod: str, node: ast.AST, is_pkg: bool, modules) -> list[tuple[str, str]]:
    """(module, dotted name) of what one import statement of ``mod`` names in flexgroup: ``from a.b import c``
    gives ``(a.b.c, a.b.c)`` when ``c`` is a module, else ``(a.b, a.b.c)``."""
    if isinstance(node, ast.Import):
        return [(a.name, a.name) for a in node.names if a.name in modules]
    pkg = mod if is_pkg else mod.rpartition(".")[0]
    if node.level:
        base = pkg
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    if target not in modules:
        return []
    return [(sub if sub in modules else target, sub) for a in node.names for sub in [f"{target}.{a.name}"]]


def _imports(sources: dict[str, str], modules):
    """(importer, imported module, dotted name) of every import statement of every module, at any depth."""
    for mod, text in sources.items():
        is_pkg = modules[mod].name == "__init__.py"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for dst, name in _named(mod, node, is_pkg, modules):
                    yield mod, dst, name


def edges_of(sources: dict[str, str], modules) -> set[tuple[str, str]]:
    """(importer, imported) for every import statement of every module, at any depth."""
    # a package's own parents are fine (flexgroup.patches._common imports flexgroup.patches), except the
    # root: it is layer 5, so a module below it that imports ``flexgroup`` is an upward edge
    return {(mod, dst) for mod, dst, _ in _imports(sources, modules)
            if dst != mod and (dst == "flexgroup" or not mod.startswith(dst + "."))}


def subpackage(mod: str) -> str:
    """The subpackage (or top-level module) ``mod`` belongs to: ``flexgroup.patches._common`` -> ``flexgroup.patches``."""
    return ".".join(mod.split(".")[:2])


def reach_ins(sources: dict[str, str], modules) -> list[str]:
    """Imports of another subpackage's private module or name (a ``_`` part, dunders aside): a layer above
    uses the names a subpackage exports (its ``__init__``, or a public name of a public module)."""
    out = set()
    for mod, dst, name in _imports(sources, modules):
        if subpackage(dst) != subpackage(mod) and any(
                p.startswith("_") and not p.startswith("__") for p in name.split(".")):
            out.add(f"{mod} imports {name}: export it from {subpackage(dst)} (a public name) instead")
    return sorted(out)


SOURCES = {m: p.read_text() for m, p in MODULES.items()}
EDGES = edges_of(SOURCES, MODULES)


def upward(edges) -> list[str]:
    return sorted(f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})" for a, b in edges if layer(b) > layer(a))


def cycle(edges) -> list[str] | None:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def top_level(modules) -> list[str]:
    return sorted(m for m, p in modules.items() if m.count(".") == 1 and p.name != "__init__.py")


def test_every_module_lives_in_a_layer():
    for mod in MODULES:
        layer(mod)


def test_imports_point_down_the_layers():
    up = upward(EDGES)
    assert not up, "upward imports:\n" + "\n".join(up)


def test_no_import_cycles():
    found = cycle(EDGES)
    assert found is None, "import cycle: " + " -> ".join(found)


def test_no_module_reaches_into_another_subpackages_private_names():
    found = reach_ins(SOURCES, MODULES)
    assert not found, "private reach-ins:\n" + "\n".join(found)


def test_flexgroup_holds_at_most_8_top_level_modules():
    top = top_level(MODULES)
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} top-level modules, move some into a layer's subpackage: {top}"
    assert top == ["flexgroup.__main__", "flexgroup.caches", "flexgroup.cli", "flexgroup.submodules"]


def test_the_root_loads_every_subpackage_on_first_use():
    import flexgroup

    subs = {m.split(".")[1] for m in MODULES if m.count(".") >= 1 and m != "flexgroup.__main__"}
    assert set(flexgroup._SUBMODULES) == subs, "name each subpackage in flexgroup/__init__.py's _SUBMODULES"


def test_every_subpackage_loads_its_submodules_on_first_use():
    """``flexgroup.layout.masks`` etc. after a bare ``import flexgroup`` (a fresh interpreter: nothing imported yet)."""
    import subprocess
    import sys

    subs = sorted(m for m in MODULES if m.count(".") == 2 and not m.split(".")[2].startswith("_")
                  and m.split(".")[1] not in ("bench", "integrations"))   # those import optional packages
    code = "import flexgroup\n" + "".join(f"flexgroup.{m.split('.', 1)[1]}\n" for m in subs)
    code += "assert not hasattr(flexgroup.layout, 'no_such_module')\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_layers_below_the_models_never_import_transformers():
    for mod, text in SOURCES.items():
        if layer(mod) < NO_TRANSFORMERS_BELOW:
            tree = ast.parse(text)
            names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
            assert "transformers" not in names, f"{mod} imports transformers"


def users_of(package: str, edges) -> list[str]:
    """The modules outside ``package`` that import it."""
    return sorted({a for a, b in edges if subpackage(b) == package and subpackage(a) != package})


def test_bench_is_imported_only_by_the_cli_and_itself():
    assert users_of("flexgroup.bench", EDGES) == ["flexgroup.cli"]


def test_the_model_zoo_is_imported_only_by_the_bench_and_the_cli():
    # the library's own layers never build a model from the zoo (stream, verification, train sit beside it)
    users = {subpackage(a) for a in users_of("flexgroup.models", EDGES)}
    assert users == {"flexgroup.bench", "flexgroup.cli"}, users
    planted = _planted("flexgroup.verification.calibration", "from ..models.zoo import build_model")
    assert "flexgroup.verification.calibration" in users_of("flexgroup.models", planted)


def test_the_checker_sees_lazy_imports():
    # GroupedBatch.model_inputs imports the carrier inside the function, and verify imports patches and
    # stock_attention inside a function: a checker that missed lazy imports would not see these edges
    assert ("flexgroup.data.batch", "flexgroup.data.carrier") in EDGES
    assert ("flexgroup.verification.equivalence", "flexgroup.reference.stock") in EDGES


# -- broken variants: each rule fails on a planted violation -------------------------------------------

def _planted(mod: str, line: str) -> set[tuple[str, str]]:
    sources = dict(SOURCES)
    sources[mod] = sources[mod] + f"\n\ndef _planted():\n    {line}\n"  # inside a function: a lazy import
    return edges_of(sources, MODULES)


def test_a_planted_upward_import_fails():
    edges = _planted("flexgroup.layout.trie", "from ..models.zoo import build_model")
    assert any("flexgroup.layout.trie (layer 1) imports flexgroup.models.zoo (layer 4)" in u for u in upward(edges))
    edges = _planted("flexgroup.verification.calibration", "from ..bench import harness")
    assert upward(edges)


def test_a_planted_cycle_fails():
    edges = _planted("flexgroup.layout.checks", "from .layout import Layout")  # layout.layout imports checks
    assert cycle(edges) is not None


def test_a_module_outside_every_layer_folder_fails():
    with pytest.raises(AssertionError, match="outside every layer"):
        layer("flexgroup.newmodule")
    assert layer("flexgroup.data.newmodule") == 2


def test_a_planted_import_of_the_root_package_below_it_fails():
    for line in ("import flexgroup", "from flexgroup import Layout", "from .. import Layout"):
        edges = _planted("flexgroup.patches.generic", line)
        assert any("flexgroup.patches.generic (layer 3) imports flexgroup (layer 5)" in u for u in upward(edges)), line
    assert ("flexgroup.patches._common", "flexgroup.patches") not in EDGES  # a package's own parent: fine


def test_a_planted_reach_into_a_private_module_or_name_fails():
    for line, name in [("from ..patches._guards import guards_of", "flexgroup.patches._guards.guards_of"),
                       ("from ..patches import _guards", "flexgroup.patches._guards"),
                       ("from flexgroup.patches import _spec", "flexgroup.patches._spec"),
                       ("import flexgroup.patches._common", "flexgroup.patches._common")]:
        sources = dict(SOURCES)
        sources["flexgroup.stream.shard"] += f"\n\ndef _planted():\n    {line}\n"
        assert any(f"flexgroup.stream.shard imports {name}:" in r for r in reach_ins(sources, MODULES)), line
    # within a subpackage a private module is fine: patches/__init__ imports patches._guards
    assert ("flexgroup.patches", "flexgroup.patches._guards") in EDGES


def test_too_many_top_level_modules_fail(tmp_path):
    pkg = tmp_path / "flexgroup"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for i in range(MAX_TOP_LEVEL + 1):
        (pkg / f"m{i}.py").write_text("")
    assert len(top_level(_modules(pkg))) == MAX_TOP_LEVEL + 1


@pytest.mark.parametrize("name", ["attention", "verify", "patch", "unpatch", "score"])
def test_no_module_is_named_like_a_function_the_package_exports(name):
    import flexgroup

    if hasattr(flexgroup, name):
        assert f"flexgroup.{name}" not in MODULES, f"flexgroup.{name} is both a module and a function"


def test_every_top_level_export_resolves_and_is_named_in_the_package_docstring():
    import flexgroup

    for name in flexgroup.__all__:
        assert getattr(flexgroup, name) is not None, name
        assert name in flexgroup.__doc__, f"flexgroup.{name} is exported but not documented in flexgroup/__init__.py"


# -- docs/architecture.md's layer table -------------------------------------------------------------

HEADER = re.compile(r"^(\d+) +(\S+) +(flexgroup/\S*)")
PATH = re.compile(r"flexgroup/[\w/]*\w(?:\.py|/)")


def doc_table(text: str) -> tuple[dict[str, int], list[tuple[int, str]]]:
    """(layer name -> level, [(level, path)]) of the first code block after '## The layers'."""
    block = text.split("## The layers", 1)[1].split("```", 2)[1]
    names, paths, level = {}, [], None
    for line in block.splitlines():
        if m := HEADER.match(line):
            level = int(m.group(1))
            names[m.group(2)] = level
        for p in PATH.findall(line):
            paths.append((level, p))
    return names, paths


def table_problems(text: str) -> list[str]:
    names, paths = doc_table(text)
    problems = []
    for level, p in paths:
        mod = p.removesuffix(".py").removesuffix("/").replace("/", ".").removesuffix(".__init__")
        if not (ROOT / p).exists():
            problems.append(f"{p}: no such file or folder")
        elif level is None or layer(mod) != level:
            problems.append(f"{p}: the table says layer {level}, LAYERS says {layer(mod)}")
    named = {p for _, p in paths}
    for key, level in LAYERS.items():
        path = "flexgroup/__init__.py" if key == "flexgroup" else (
            key.replace(".", "/") + ("/" if (ROOT / key.replace(".", "/")).is_dir() else ".py"))
        if not any(n == path or n.startswith(path) for n in named):
            problems.append(f"{key} (layer {level}) is missing from the table ({path})")
    return problems


def test_the_docs_layer_table_matches_LAYERS():
    problems = table_problems((ROOT / "docs" / "architecture.md").read_text())
    assert not problems, "docs/architecture.md's layer table:\n" + "\n".join(problems)


def test_the_docs_table_check_catches_a_wrong_level_and_a_missing_layer():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert re.search(r"^3 patches ", text, re.M)
    wrong = re.sub(r"^3 patches ", "2 patches ", text, flags=re.M)
    assert any("LAYERS says 3" in p for p in table_problems(wrong))
    missing = text.replace("flexgroup/__main__.py", "flexgroup/cli.py")
    assert any("flexgroup.__main__ (layer 9) is missing" in p for p in table_problems(missing))


SUBPACKAGES = sorted({subpackage(m) for m in MODULES if m.count(".") >= 2})


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_every_subpackage_export_resolves_and_is_no_submodule_name(package):
    import importlib

    pkg = importlib.import_module(package)
    exported = getattr(pkg, "__all__", [])
    if package.split(".")[1] in ("bench", "integrations"):
        return  # their exports import optional packages
    for name in exported:
        assert getattr(pkg, name) is not None, f"{package}.{name} is exported but does not resolve"
        assert f"{package}.{name}" not in MODULES, f"{package}.{name} is both a submodule and an exported name"


def test_data_train_verification_and_reference_export_their_public_names():
    import importlib

    for package in ("flexgroup.data", "flexgroup.train", "flexgroup.verification", "flexgroup.reference"):
        assert importlib.import_module(package).__all__, f"{package} exports nothing"


def test_an_export_named_like_its_module_is_refused():
    from flexgroup.submodules import loader

    with pytest.raises(ValueError, match="rename the module"):
        loader("flexgroup.verification", {"verify": "verify"})  # the clash this layout had before equivalence.py
