"""Rewrite old flexgroup import paths to the new ones (issue 33's layer subpackages), in place.

    python tools/rewrite_imports.py flexgroup tests docs README.md benchmarks examples .ci
    python tools/rewrite_imports.py --check flexgroup tests ...      # exit 1 if an old path remains
    python tools/rewrite_imports.py --map=flexgroup.stream_foo=flexgroup.stream.foo \\
        --map=tests/front/test_foo.py=tests/stream/test_foo.py  flexgroup tests docs

What it rewrites (files ending .py .md .toml .ini .cfg .txt .sh .yml .yaml, and extension-less scripts):

- dotted paths of :data:`flexgroup._moved.MOVED` (plus ``--map=OLD=NEW`` with a dotted OLD) anywhere:
  ``import`` lines, ``mock.patch("flexgroup.batch.x")`` targets, docs. ``flexgroup.patterns`` and
  ``flexgroup.score_mods`` are also public attributes of ``flexgroup``: written as an attribute in code or in
  backticks (``flexgroup.patterns.causal()``) they stay; in import lines and quoted strings they move;
- the two shadowed modules (``flexgroup.layout``, ``flexgroup.stream``, now packages re-exporting their
  public names): only private names move (``flexgroup.stream._check_budget`` ->
  ``flexgroup.stream.front._check_budget``, and ``from flexgroup.stream import _x``);
- relative imports inside ``flexgroup/``: resolved against the file's *old* place when they do not resolve
  against its new one, mapped, and written relative to the new place (``from .layout import Layout`` in
  ``flexgroup/data/batch.py`` -> ``from ..layout import Layout``; ``from . import stream_shard`` ->
  ``from . import shard as stream_shard``);
- file paths: ``flexgroup/equivalence.py`` -> ``flexgroup/verification/verify.py`` and the moved test
  files (:data:`PATHS`, plus ``--map=OLD=NEW`` with a ``/`` in OLD).

Idempotent: a second run changes nothing. Lines holding ``old-path: keep`` are left alone (a table that names
the old paths on purpose); so are this file, ``flexgroup/_moved.py`` and ``tests/package/test_moved.py``.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flexgroup._moved import MOVED, SHADOWED  # noqa: E402  (torch-free)

# module files moved (for docs naming the file): old path -> new path
MODULE_PATHS = {f"{o.replace('.', '/')}.py": f"{n.replace('.', '/')}.py"
                for o, n in {**MOVED, **SHADOWED}.items() if o != "flexgroup.models"}
MODULE_PATHS["flexgroup/models.py"] = "flexgroup/bench/zoo.py"

# test files moved by the house restructure: old path -> new path
_TESTS = {
    "core": {"test_architecture.py": "package", "test_layout.py": "layout", "test_sequence_ends.py": "data"},
    "masks": {"test_block_masks.py": "layout", "test_patterns.py": "layout"},
    "data": {"test_stream_plan.py": "stream"},
    "front": {
        **dict.fromkeys(["_trl_dist.py", "_verl_e2e_harness.py", "_verl_harness.py", "_verl_ulysses_harness.py",
                         "test_lm_eval_truncation.py", "test_trl.py", "test_trl_distributed.py", "test_trl_dpo.py",
                         "test_trl_grpo_accumulation.py", "test_trl_grpo_budget.py", "test_trl_grpo_entropy.py",
                         "test_trl_grpo_overrides.py", "test_verl.py", "test_verl_e2e.py", "test_verl_plan.py",
                         "test_verl_ulysses.py", "test_verl*.py", "test_trl*.py"], "integrations"),
        **dict.fromkeys(["_verify_memory_child.py", "test_closure_forward.py", "test_grad_difference.py",
                         "test_verify.py", "test_verify_calibration.py", "test_verify_memory.py",
                         "test_verify_resolution.py", "test_verify_vision.py"], "verification"),
        **dict.fromkeys(["test_bench_stream.py", "test_bench_workloads.py", "test_summarize.py",
                         "test_gpu_check.py"], "bench"),
        "test_cli.py": "cli",
        **dict.fromkeys(["test_doc_names.py", "test_readme.py", "test_examples.py", "test_feature_matrix.py"], "docs"),
        "test_entry_refusals.py": "package",
        **dict.fromkeys(["test_evaluation.py", "test_scoring.py", "test_score_model_errors.py", "test_grpo.py",
                         "test_grpo_learn.py"], "train"),
        **dict.fromkeys(["test_layerwise.py", "test_layerwise_leaves_no_trace.py"], "reference"),
        **dict.fromkeys(["test_stream.py", "test_stream_hybrids.py", "test_stream_sequence_parallel.py",
                         "test_stream_temperature.py", "test_stream*.py"], "stream"),
    },
    "models": dict.fromkeys(
        ["test_exact_or_loud.py", "test_flash_refused.py", "test_fsdp.py", "test_fsdp_generic.py",
         "test_grouped_equals_stock.py", "test_guards.py", "test_hybrid_refusals.py", "test_hybrids.py",
         "test_inference_mode.py", "test_lse_models.py", "test_patch.py", "test_random_ops_in_grouped_forward.py",
         "test_sequence_guards.py", "test_sequence_parallel.py", "test_vl.py", "test_vl_combinations.py",
         "test_vl_sequence_parallel.py"], "patches"),
}
TEST_PATHS = {f"tests/{old}/{f}": f"tests/{new}/{f}" for old, files in _TESTS.items() for f, new in files.items()}
PATHS = {**MODULE_PATHS, **TEST_PATHS}

PUBLIC_ATTRS = {"flexgroup.patterns", "flexgroup.score_mods"}  # also attributes of the flexgroup package
SUFFIXES = {".py", ".md", ".toml", ".ini", ".cfg", ".txt", ".sh", ".yml", ".yaml", ""}
SKIP = {ROOT / "tools" / "rewrite_imports.py", ROOT / "flexgroup" / "_moved.py",
        ROOT / "tests" / "package" / "test_moved.py"}
KEEP = "old-path: keep"


def _modules(root: Path) -> set[str]:
    """Every flexgroup module and package in the tree at ``root``."""
    out = set()
    for f in (root / "flexgroup").rglob("*.py"):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.add(".".join(parts))
    return out


class Rewriter:
    def __init__(self, moved: dict[str, str], paths: dict[str, str], root: Path = ROOT, imports_only: bool = False):
        self.imports_only = imports_only
        self.moved = dict(moved)
        self.paths = dict(paths)
        self.root = root
        self.modules = _modules(root)
        self.old_of = {v: k for k, v in {**self.moved, **SHADOWED}.items()}  # new module -> its old name
        names = "|".join(re.escape(k) for k in sorted(self.moved, key=len, reverse=True))
        self._dotted = re.compile(rf"(?<![\w.])({names})(?![\w])")
        sh = "|".join(re.escape(k) for k in SHADOWED)
        self._private = re.compile(rf"(?<![\w.])({sh})\.(_[A-Za-z]\w*)")
        pn = "|".join(re.escape(k) for k in sorted(self.paths, key=len, reverse=True))
        self._path = re.compile(rf"(?<![\w])({pn})(?![\w])")

    # -- text rules -------------------------------------------------------------------------------------
    def _line(self, line: str) -> str:
        if KEEP in line:
            return line
        is_import = bool(re.match(r"\s*(from|import)\s", line))
        if self.imports_only and not is_import:
            return line

        def dotted(m):
            old = m.group(1)
            if old in PUBLIC_ATTRS and not is_import and (m.start() == 0 or line[m.start() - 1] not in "'\""):
                return old
            return self.moved[old]

        line = self._dotted.sub(dotted, line)
        line = self._private.sub(lambda m: f"{SHADOWED[m.group(1)]}.{m.group(2)}"
                                 if f"{m.group(1)}.{m.group(2)}" not in self.modules else m.group(0), line)
        return self._path.sub(lambda m: self.paths[m.group(1)], line)

    # -- python: imports read by ast --------------------------------------------------------------------
    def _module_of(self, path: Path) -> tuple[str, bool] | None:
        try:
            rel = path.resolve().relative_to(self.root)
        except ValueError:
            return None
        if rel.parts[0] != "flexgroup":
            return None
        parts = list(rel.with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        return ".".join(parts[:-1] if is_pkg else parts), is_pkg

    @staticmethod
    def _base(mod: str, is_pkg: bool, level: int) -> str:
        base = mod if is_pkg else mod.rpartition(".")[0]
        for _ in range(level - 1):
            base = base.rpartition(".")[0]
        return base

    def _map(self, old: str) -> str:
        return self.moved.get(old, old)

    @staticmethod
    def _relative(src_pkg: str, target: str) -> tuple[int, str]:
        """(level, module) of ``target`` imported from package ``src_pkg``."""
        a, b = src_pkg.split("."), target.split(".")
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return len(a) - n + 1, ".".join(b[n:])

    def _python_imports(self, path: Path, text: str) -> str:
        where = self._module_of(path)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return text
        lines = text.splitlines(keepends=True)
        edits = []  # (line index, new statement head)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0:
                if node.module in SHADOWED and any(a.name.startswith("_") and f"{node.module}.{a.name}" not in self.modules
                                                   for a in node.names):
                    edits.append((node, 0, SHADOWED[node.module], None))
                elif node.module and any(f"{node.module}.{a.name}" in self.moved and f"{node.module}.{a.name}" not in PUBLIC_ATTRS
                                         for a in node.names):  # from flexgroup import padded
                    targets = [self._map(f"{node.module}.{a.name}") for a in node.names]
                    parents = {t.rpartition(".")[0] for t in targets}
                    if len(parents) == 1 and all(t in self.modules for t in targets):
                        names = [a.name if t.rpartition(".")[2] == a.name and not a.asname else
                                 f"{t.rpartition('.')[2]} as {a.asname or a.name}" for a, t in zip(node.names, targets)]
                        edits.append((node, 0, parents.pop(), names))
                continue
            if where is None:
                continue
            mod, is_pkg = where
            new_base = self._base(mod, is_pkg, node.level)
            old_mod = self.old_of.get(mod, mod)
            old_is_pkg = is_pkg if mod not in self.old_of else False
            old_base = self._base(old_mod, old_is_pkg, node.level)
            if node.module:
                if f"{new_base}.{node.module}" in self.modules:
                    continue
                target = self._map(f"{old_base}.{node.module}")
                if target not in self.modules:
                    continue
                level, rel = self._relative(mod if is_pkg else mod.rpartition(".")[0], target)
                edits.append((node, level, rel, None))
            else:  # from . import a, b: each name a module (or a name of the package itself)
                targets = []
                for a in node.names:
                    old = f"{old_base}.{a.name}"
                    if f"{new_base}.{a.name}" in self.modules or (new_base == old_base and old not in self.moved):
                        targets.append(f"{new_base}.{a.name}")
                    elif self._map(old) in self.modules:
                        targets.append(self._map(old))
                    else:
                        targets = None  # a name that is no module, seen from a file that moved: left alone
                        break
                if targets is None or all(t == f"{new_base}.{a.name}" for a, t in zip(node.names, targets)):
                    continue
                parents = {t.rpartition(".")[0] for t in targets}
                if len(parents) != 1:
                    continue
                level, rel = self._relative(mod if is_pkg else mod.rpartition(".")[0], parents.pop())
                names = [a.name if t.rpartition(".")[2] == a.name and not a.asname else
                         f"{t.rpartition('.')[2]} as {a.asname or a.name}" for a, t in zip(node.names, targets)]
                edits.append((node, level, rel, names))
        for node, level, rel, names in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
            i = node.lineno - 1
            line = lines[i]
            head = re.compile(r"from\s+[.\w]+\s+import\s+")
            m = head.match(line, node.col_offset)
            if m is None:
                continue
            new_head = f"from {'.' * level}{rel} import "
            if names is None:
                lines[i] = line[:m.start()] + new_head + line[m.end():]
            else:  # one-line `from . import a, b` only
                if node.end_lineno != node.lineno:
                    continue
                tail = line[node.end_col_offset:]
                lines[i] = line[:m.start()] + new_head + ", ".join(names) + tail
        return "".join(lines)

    def rewrite(self, path: Path) -> bool:
        text = path.read_text()
        new = text
        if path.suffix == ".py":
            new = self._python_imports(path, new)
        new = "".join(self._line(l) for l in new.splitlines(keepends=True))
        if new != text:
            path.write_text(new)
            return True
        return False

    def leftovers(self, path: Path) -> list[str]:
        out = []
        text = path.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            if self._line(line) != line:
                out.append(f"{path}:{n}: {line.strip()}")
        if path.suffix == ".py" and self._python_imports(path, text) != text:
            out.append(f"{path}: a relative import still points at an old place")
        return out


def _files(args: list[str]):
    for a in args:
        p = Path(a)
        if p.is_file():
            yield p
        elif p.is_dir():
            for f in sorted(p.rglob("*")):
                if (f.is_file() and f.suffix in SUFFIXES and "__pycache__" not in f.parts
                        and not any(part.startswith(".") and part not in (".ci",) for part in f.parts)
                        and not f.name.startswith(".")):
                    yield f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="files and folders to rewrite")
    ap.add_argument("--map", action="append", default=[], metavar="OLD=NEW",
                    help="an extra mapping: dotted module path, or a file path when OLD holds a '/'")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if an old path remains")
    ap.add_argument("--imports-only", action="store_true",
                    help="rewrite import statements only (leave docstrings, comments and strings: fewer merge conflicts)")
    args = ap.parse_args(argv)
    moved, paths = dict(MOVED), dict(PATHS)
    for m in args.map:
        old, sep, new = m.partition("=")
        if not sep or not old or not new:
            ap.error(f"--map={m!r}: write --map=OLD=NEW")
        (paths if "/" in old else moved)[old] = new
    rw = Rewriter(moved, paths, imports_only=args.imports_only)
    files = [f for f in _files(args.paths) if f.resolve() not in SKIP]
    if args.check:
        bad = [l for f in files for l in rw.leftovers(f)]
        print("\n".join(bad) if bad else f"no old path in {len(files)} files")
        return 1 if bad else 0
    changed = [f for f in files if rw.rewrite(f)]
    print(f"rewrote {len(changed)} of {len(files)} files")
    for f in changed:
        print(f"  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
