"""The package's import graph: imports point down the layers of docs/architecture.md, with no cycles.

Every import is counted -- module level and inside functions -- by reading the source (``ast``), so a
lazy import cannot hide an upward edge. There is no whitelist: no module imports from a layer above
its own, and the import graph has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# layer of each module (longest matching prefix wins); higher number = higher layer
LAYERS = {
    "flexgroup.layout": 0, "flexgroup.layout.checks": 0,            # core
    "flexgroup.layout.patterns": 1, "flexgroup.layout.score_mods": 1, "flexgroup.layout.blockmask": 1, "flexgroup.layout.masks": 1,   # masks
    "flexgroup.kernels": 2,                                  # kernels
    "flexgroup.kernels.lse": 2, "flexgroup.kernels.lse_plan": 2, "flexgroup.kernels.lse_ops": 2,
    "flexgroup.data.carrier": 3, "flexgroup.data.sharding": 3, "flexgroup.layout.trie": 3, "flexgroup.reference.oracle": 3, "flexgroup.data.batch": 3, "flexgroup.data.padded": 3, "flexgroup.data.mrope": 3, "flexgroup.data.multimodal": 3,  # data
    "flexgroup.stream.plan": 3, "flexgroup.stream.chunk_carrier": 3, "flexgroup.data.readout": 3,
    "flexgroup.patches": 4,                                  # models (transformers glue, architectures)
    "flexgroup.verification.verify": 5, "flexgroup.verification.calibration": 5, "flexgroup.reference.layerwise": 5, "flexgroup.verification.report": 5, "flexgroup.verification.memory": 5, "flexgroup.train.grpo": 5, "flexgroup.train.scoring": 5, "flexgroup.train.evaluation": 5,
    "flexgroup.integrations": 5, "flexgroup.integrations.verl": 5, "flexgroup.bench": 5, "flexgroup.bench.zoo": 5, "flexgroup.cli": 5,
    "flexgroup.__main__": 5, "flexgroup.stream": 5,          # front
    "flexgroup": 5,                                          # the package root re-exports (lazily) from all
}
NAMES = {0: "core", 1: "masks", 2: "kernels", 3: "data", 4: "models", 5: "front"}


def _modules() -> dict[str, Path]:
    mods = {}
    for base, pkg in ((ROOT / "flexgroup", "flexgroup"),):
        for f in base.rglob("*.py"):
            rel = f.relative_to(base).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


MODULES = _modules()


def layer(mod: str) -> int:
    best = max((p for p in LAYERS if mod == p or mod.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{mod} has no layer: add it to LAYERS in tests/package/test_architecture.py "
                             "and to docs/architecture.md")
    return LAYERS[best]


def _resolve(mod: str, node: ast.AST, is_pkg: bool) -> set[str]:
    """flexgroup modules imported by one import statement of ``mod``."""
    out = set()
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        return {n for n in names if n in MODULES}
    pkg = mod if is_pkg else mod.rpartition(".")[0]
    if node.level:
        base = pkg
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    if target not in MODULES:
        return out
    for a in node.names:
        sub = f"{target}.{a.name}"
        out.add(sub if sub in MODULES else target)
    return out


def _edges() -> set[tuple[str, str]]:
    edges = set()
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for dst in _resolve(mod, node, path.name == "__init__.py"):
                    if dst != mod and not mod.startswith(dst + "."):  # a package's own parents are fine
                        edges.add((mod, dst))
    return edges


EDGES = _edges()


def test_every_module_has_a_layer():
    for mod in MODULES:
        layer(mod)


def test_imports_point_down_the_layers():
    up = sorted(f"{a} ({NAMES[layer(a)]}) imports {b} ({NAMES[layer(b)]})" for a, b in EDGES
                if layer(b) > layer(a))
    assert not up, "upward imports:\n" + "\n".join(up)


def test_the_core_and_masks_and_kernels_never_import_transformers():
    for mod, path in MODULES.items():
        if layer(mod) <= LAYERS["flexgroup.data.carrier"]:
            tree = ast.parse(path.read_text())
            names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            assert "transformers" not in names, f"{mod} imports transformers"


def test_no_import_cycles():
    graph: dict[str, set[str]] = {}
    for a, b in EDGES:
        graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checker_sees_lazy_imports():
    # GroupedBatch.model_inputs imports the carrier inside the function: if the checker missed lazy
    # imports this edge would not be in EDGES, and a lazy upward import could hide
    assert ("flexgroup.data.batch", "flexgroup.data.carrier") in EDGES


def test_the_core_imports_nothing_above_it():
    assert not [(a, b) for a, b in EDGES if layer(a) == 0 and layer(b) > 0]


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


def test_no_module_outside_the_bench_package_is_over_420_lines():
    long = {mod: n for mod, path in MODULES.items() if not mod.startswith("flexgroup.bench")
            and (n := len(path.read_text().splitlines())) > 420}
    assert not long, f"split these by idea (docs/architecture.md): {long}"
