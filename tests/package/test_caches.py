"""The one cache policy (flexgroup/caches.py): every cache listed with its key and bound, none keyed on
a user callable, each bounded -- and the stale block mask it found, fixed.

The enumeration reads the source (``ast``): every module-level empty container (``{}``, ``dict()``, ``set()``,
``OrderedDict()``, weak dicts and sets), every ``lru_cache`` / ``functools.cache`` and every ``cached_property``
in ``flexgroup/`` must be registered, so a new cache fails here until it is given a key and a bound.
"""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

import pytest
import torch

from flexgroup import caches
from flexgroup.layout import Layout, masks, patterns

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS = {"dict", "set", "OrderedDict", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "defaultdict"}


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def found_in_source(root: Path = ROOT / "flexgroup") -> set[str]:
    """``module:name`` of every cache-like definition under ``root`` (see the module docstring)."""
    out = set()
    for f in root.rglob("*.py"):
        mod, tree = _module(f, root), ast.parse(f.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                v = node.value
                empty = (isinstance(v, ast.Dict) and not v.keys) or (
                    isinstance(v, ast.Call) and not v.args and not v.keywords
                    and (getattr(v.func, "id", None) or getattr(v.func, "attr", None)) in CONTAINERS)
                if empty:
                    target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                    out.add(f"{mod}:{ast.unparse(target)}")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for d in node.decorator_list:
                    text = ast.unparse(d)
                    if "cached_property" in text:
                        out.add(f"{mod}:{_owner(tree, node)}.<cached_property>")
                    elif "lru_cache" in text or text in ("cache", "functools.cache"):
                        out.add(f"{mod}:{node.name}")
    return out


def _owner(tree: ast.Module, fn: ast.FunctionDef) -> str:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and fn in node.body:
            return node.name
    return "?"


REGISTERED = {c.where for c in caches.CACHES + caches.REGISTRIES}


def test_every_cache_in_the_source_is_registered():
    missing = sorted(found_in_source() - REGISTERED)
    assert not missing, ("register these in flexgroup/caches.py (key and bound), or make them per-object: "
                         + ", ".join(missing))


def test_the_enumeration_finds_a_new_cache(tmp_path):
    # broken variant: a module that adds an unregistered cache is caught
    pkg = tmp_path / "flexgroup" / "data"
    pkg.mkdir(parents=True)
    (pkg / "newcache.py").write_text("import functools\n_MEMO = {}\n\n@functools.lru_cache(maxsize=8)\ndef f(x):\n"
                                     "    return x\n\nclass C:\n    @functools.cached_property\n    def p(self):\n"
                                     "        return 1\n")
    found = {w.split("flexgroup.", 1)[-1] for w in found_in_source(tmp_path / "flexgroup")}
    assert {"data.newcache:_MEMO", "data.newcache:f", "data.newcache:C.<cached_property>"} <= found, found


@pytest.mark.parametrize("entry", caches.CACHES + caches.REGISTRIES, ids=lambda c: c.where)
def test_every_registered_entry_exists_and_is_bounded(entry):
    mod, _, attr = entry.where.partition(":")
    if mod.startswith("flexgroup.integrations.verl"):
        pytest.importorskip("verl")
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        pytest.skip(f"{mod}: {e}")
    obj = module
    for part in attr.replace(".<cached_property>", "").split("."):
        obj = getattr(obj, part, None) if not isinstance(obj, type) or part != "_plans" else obj
    if attr.endswith("._plans"):  # an instance attribute: checked on an instance below
        return
    assert obj is not None, entry.where
    assert entry.key and entry.bound
    if entry.kind == "lru_cache":
        assert obj.cache_info().maxsize is not None, f"{entry.where}: an unbounded lru_cache"
        assert f"maxsize={obj.cache_info().maxsize}" in entry.bound


def test_the_lru_bounds_hold():
    masks._BLOCK_MASKS.clear()
    for n in range(masks.BLOCK_MASK_CACHE_SIZE + 5):
        masks.block_mask(Layout.group(prefix_len=3 + n, response_lens=[2, 1]), patterns.sliding_window(4))
    assert len(masks._BLOCK_MASKS) == masks.BLOCK_MASK_CACHE_SIZE


def test_clear_empties_every_process_wide_cache():
    lay = Layout.group(prefix_len=5, response_lens=[3, 2])
    masks.block_mask(lay, None)
    assert masks._BLOCK_MASKS
    caches.clear()
    assert not masks._BLOCK_MASKS


# -- user callables: never a cache key ------------------------------------------------------------------

def _window_from(state: dict):
    def user_pattern(q_pos, kv_pos):  # reads mutable state: the same callable, different answers
        return (q_pos - kv_pos) < state["w"]
    return user_pattern


def _token_mask(bm, L: int) -> torch.Tensor:
    """The [L, L] bool mask a BlockMask applies: full blocks whole, partial blocks through its mask_mod."""
    bs = bm.BLOCK_SIZE[0]
    partial = bm.to_dense()[0, 0].bool()  # to_dense counts partial and full blocks
    full = torch.zeros_like(partial)
    num, idx = bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]
    for i in range(full.shape[0]):
        full[i, idx[i, : num[i]].long()] = True
    up = lambda t: t.repeat_interleave(bs, 0).repeat_interleave(bs, 1)[:L, :L]  # noqa: E731
    q, kv = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return up(full) | (up(partial & ~full) & bm.mask_mod(0, 0, q, kv))


def test_a_user_pattern_that_changes_is_answered_by_its_new_behaviour():
    lay = Layout.tree(parents=[-1, 0, 0], lengths=[300, 200, 100])  # 600 tokens: 5 blocks of 128
    state = {"w": 1000}
    fn = _window_from(state)
    wide = masks.block_mask(lay, fn)
    assert torch.equal(_token_mask(wide, lay.num_tokens), lay.dense_mask(fn))
    state["w"] = 130
    narrow = masks.block_mask(lay, fn)
    assert narrow is not wide  # built anew: the cache never holds a user callable
    assert torch.equal(_token_mask(narrow, lay.num_tokens), lay.dense_mask(fn))
    assert not torch.equal(lay.dense_mask(fn), _token_mask(masks.block_mask(lay, None), lay.num_tokens))  # it bites


def test_frozen_patterns_are_still_cached_by_value():
    lay = Layout.group(prefix_len=40, response_lens=[9, 7])
    a = masks.block_mask(lay, patterns.sliding_window(8))
    b = masks.block_mask(Layout.group(prefix_len=40, response_lens=[9, 7]), patterns.sliding_window(8))
    assert a is b  # equal layouts and equal frozen patterns: one entry


def test_no_process_wide_cache_key_holds_a_user_callable():
    lay = Layout.group(prefix_len=20, response_lens=[5, 4])
    masks._BLOCK_MASKS.clear()
    masks.block_mask(lay, lambda q, kv: q >= kv)
    masks.block_mask(lay, patterns.from_callable(lambda q, kv: q >= kv))
    assert not masks._BLOCK_MASKS
    import flexgroup.kernels as kernels

    kernels._PLANS.clear()
    q = k = v = torch.randn(1, 2, lay.num_tokens, 4)
    kernels.attention(q, k, v, lay, pattern=lambda qp, kp: qp >= kp, backend="sdpa")
    assert not kernels._PLANS


def test_functools_lru_caches_in_the_package_are_all_bounded():
    for entry in caches.CACHES:
        if entry.kind == "lru_cache":
            mod, _, attr = entry.where.partition(":")
            fn = getattr(importlib.import_module(mod), attr)
            assert isinstance(fn, functools._lru_cache_wrapper) and fn.cache_info().maxsize is not None
