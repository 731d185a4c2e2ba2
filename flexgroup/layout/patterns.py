"""Attention patterns and score_mods on *virtual* positions.

A pattern is a callable ``(q_pos, kv_pos) -> BoolTensor`` evaluated elementwise (with broadcasting)
on virtual positions; the layout's tree-causal rule is always applied on top of it. Because every
pattern sees virtual positions, a grouped row reproduces what each root-to-leaf sequence computes
alone (a window counts tokens of the sequence, not of the packed row).

Built-in patterns also know their *block bounds*: for a rectangle of positions
``q in [q_lo, q_hi]``, ``kv in [kv_lo, kv_hi]`` restricted to causal pairs ``kv <= q`` they return
``(any, all)`` -- whether some pair is allowed (exact) and whether every pair is allowed. The
block-mask builder uses them to skip empty blocks and to mark full blocks. A plain user callable has
no bounds: the builder then treats every tree-allowed block as partial, which is always correct,
only slower.

score_mods live in :mod:`flexgroup.layout.score_mods`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from .checks import is_int

__all__ = ["Pattern", "sliding_window", "chunked", "sinks", "prefix_tokens", "strided", "block_sparse",
           "from_callable", "all_of", "any_of"]

Tensor = torch.Tensor


def _ceil_mul_ge(lo: Tensor, hi: Tensor, m: int) -> Tensor:
    """True where the integer interval [lo, hi] contains a multiple of m (lo <= hi assumed)."""
    first = torch.div(lo + m - 1, m, rounding_mode="floor") * m
    return first <= hi


class Pattern:
    """Base class: subclasses define ``__call__(q_pos, kv_pos)`` and ``bounds``.

    ``frozen``: the pattern's answers are a function of its (immutable) fields only, so a plan built
    from it may be reused across forwards. False for user callables (a closure can change).
    """

    __name__ = "pattern"
    frozen = True

    def __call__(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def bounds(self, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]:
        """(any, all) over ``{(q, kv): q_lo<=q<=q_hi, kv_lo<=kv<=kv_hi, kv<=q}`` (non-empty).

        ``any`` must be True whenever an allowed pair exists; ``all`` only when every pair is allowed.
        The default is the always-correct conservative answer.
        """
        return torch.ones_like(q_lo, dtype=torch.bool), torch.zeros_like(q_lo, dtype=torch.bool)

    def to_device(self, device) -> "Pattern":
        """This pattern with its constant tensors on ``device`` (``self`` when it has none)."""
        return self

    def __and__(self, other: "Pattern | Callable") -> "Pattern":
        return all_of(self, other)

    def __or__(self, other: "Pattern | Callable") -> "Pattern":
        return any_of(self, other)

    def __repr__(self) -> str:
        return self.__name__


class _IntParams:
    """Mixin for patterns with integer parameters (``_params`` names them).

    ``to_device`` returns a copy whose parameters are also 0-d tensors on that device, and
    ``__call__`` uses those. Inside a compiled kernel a captured Python int is a constant that
    torch.compile specialises on: a new window and a new row length in one process made CPU inductor
    emit uncompilable C++ (torch 2.13); a 0-d tensor is an ordinary input and never recompiles.
    """

    _params: tuple = ()

    def to_device(self, device):
        t = tuple(torch.tensor(getattr(self, f), dtype=torch.long, device=device) for f in self._params)
        return dataclasses.replace(self, _t=t)

    def _c(self, i: int):
        return self._t[i] if self._t is not None else getattr(self, self._params[i])


_T = dict(default=None, compare=False, hash=False, repr=False)


def _as_pattern(p) -> Pattern:
    if isinstance(p, Pattern):
        return p
    if callable(p):
        return from_callable(p)
    raise TypeError(f"a pattern must be a callable (q_pos, kv_pos) -> BoolTensor, got {type(p).__name__}")


@dataclass(frozen=True, eq=True)
class _SlidingWindow(_IntParams, Pattern):
    window: int
    _t: tuple | None = field(**_T)
    _params = ("window",)

    @property
    def __name__(self):
        return f"sliding_window_{self.window}"

    def __call__(self, q_pos, kv_pos):
        return q_pos - kv_pos < self._c(0)

    def bounds(self, q_lo, q_hi, kv_lo, kv_hi):
        return (q_lo - kv_hi).clamp(min=0) < self.window, q_hi - kv_lo < self.window


def sliding_window(window: int) -> Pattern:
    """kv within the last ``window`` virtual positions, itself included: ``q - kv < window``.

    This is transformers' convention (``sliding_window`` in Mistral, Qwen2, Gemma 2 configs).
    """
    if not is_int(window, 1):
        raise ValueError(f"sliding_window({window!r}): the window must be an int >= 1")
    return _SlidingWindow(window)


@dataclass(frozen=True, eq=True)
class _Chunked(_IntParams, Pattern):
    size: int
    _t: tuple | None = field(**_T)
    _params = ("size",)

    @property
    def __name__(self):
        return f"chunked_{self.size}"

    def __call__(self, q_pos, kv_pos):
        size = self._c(0)
        return torch.div(q_pos, size, rounding_mode="floor") == torch.div(kv_pos, size, rounding_mode="floor")

    def bounds(self, q_lo, q_hi, kv_lo, kv_hi):
        s = self.size
        f = lambda x: torch.div(x, s, rounding_mode="floor")  # noqa: E731
        any_ = torch.maximum(f(q_lo), f(kv_lo)) <= torch.minimum(f(q_hi), f(kv_hi))
        all_ = (f(q_lo) == f(q_hi)) & (f(kv_lo) == f(kv_hi)) & (f(q_lo) == f(kv_lo))
        return any_, all_


def chunked(size: int) -> Pattern:
    """Same chunk of virtual positions: ``q // size == kv // size`` (Llama 4 style local attention)."""
    if not is_int(size, 1):
        raise ValueError(f"chunked({size!r}): the chunk size must be an int >= 1")
    return _Chunked(size)


@dataclass(frozen=True, eq=True)
class _PrefixTokens(_IntParams, Pattern):
    n: int
    _t: tuple | None = field(**_T)
    _params = ("n",)

    @property
    def __name__(self):
        return f"first_{self.n}"

    def __call__(self, q_pos, kv_pos):
        return kv_pos < self._c(0)

    def bounds(self, q_lo, q_hi, kv_lo, kv_hi):
        return kv_lo < self.n, kv_hi < self.n


def prefix_tokens(n: int) -> Pattern:
    """kv among the first ``n`` virtual positions of the sequence (attention sinks, global tokens)."""
    if not is_int(n, 0):
        raise ValueError(f"prefix_tokens({n!r}): n must be an int >= 0")
    return _PrefixTokens(n)


def sinks(n: int, window: int) -> Pattern:
    """The first ``n`` virtual positions (sinks) plus a sliding window of ``window``."""
    return any_of(prefix_tokens(n), sliding_window(window))


@dataclass(frozen=True, eq=True)
class _Strided(_IntParams, Pattern):
    stride: int
    _t: tuple | None = field(**_T)
    _params = ("stride",)

    @property
    def __name__(self):
        return f"strided_{self.stride}"

    def __call__(self, q_pos, kv_pos):
        return torch.remainder(q_pos - kv_pos, self._c(0)) == 0

    def bounds(self, q_lo, q_hi, kv_lo, kv_hi):
        # over causal pairs q - kv takes every integer in [max(0, q_lo - kv_hi), q_hi - kv_lo]
        lo = (q_lo - kv_hi).clamp(min=0)
        hi = q_hi - kv_lo
        all_ = (lo == hi) & (torch.remainder(lo, self.stride) == 0)
        return _ceil_mul_ge(lo, hi, self.stride), all_ | (self.stride == 1)


def strided(stride: int, local: int = 0) -> Pattern:
    """Sparse-Transformer strided pattern: ``(q - kv) % stride == 0``, or within a local window.

    ``local > 0`` adds ``sliding_window(local)`` (the usual local + strided pair of heads, in one).
    """
    if not is_int(stride, 1):
        raise ValueError(f"strided({stride!r}): the stride must be an int >= 1")
    p: Pattern = _Strided(stride)
    return any_of(p, sliding_window(local)) if local > 0 else p


@dataclass(frozen=True, eq=False)
class _BlockSparse(_IntParams, Pattern):
    block: int
    allowed: Tensor  # bool [nq, nkv] over blocks of virtual positions
    _t: tuple | None = field(**_T)
    _params = ("block",)

    @property
    def __name__(self):
        return f"block_sparse_{self.block}"

    def __call__(self, q_pos, kv_pos):
        a = self.allowed.to(q_pos.device)
        block = self._c(0)
        qb = torch.div(q_pos, block, rounding_mode="floor").clamp(max=a.shape[0] - 1)
        kb = torch.div(kv_pos, block, rounding_mode="floor").clamp(max=a.shape[1] - 1)
        return a[qb, kb]

    def to_device(self, device):
        return dataclasses.replace(_IntParams.to_device(self, device), allowed=self.allowed.to(device))

    def bounds(self, q_lo, q_hi, kv_lo, kv_hi):
        # Exact. In unclamped block coordinates the rectangle's causal pairs occupy the cells
        # (i, j), QA <= i <= QB, KA <= j <= min(KB, i): every cell below the diagonal holds a causal
        # pair, and so does every diagonal cell because the set of causal pairs is non-empty
        # (kv_lo <= q_hi). Rows i < nq - 1 map to themselves: a staircase rectangle query on 2-D
        # prefix sums of (allowed & c <= r). Rows i >= nq - 1 all map to the last row; together they
        # reach columns [KA, min(KB, QB)]: a 1-D query. Columns past the table map to the last one.
        a = self.allowed.to(q_lo.device)
        nq, nkv = a.shape
        f = lambda x: torch.div(x, self.block, rounding_mode="floor")  # noqa: E731
        QA, QB, KA, KB = f(q_lo), f(q_hi), f(kv_lo), f(kv_hi)
        ka, kb = KA.clamp(max=nkv - 1), KB.clamp(max=nkv - 1)
        stair = torch.ones(nq, nkv, dtype=torch.bool, device=a.device).tril()

        def prefix2(t):  # [nq+1, nkv+1] inclusive prefix sums with a zero border
            return torch.nn.functional.pad(t.long().cumsum(0).cumsum(1), (1, 0, 1, 0))

        def rect(c, r0, r1, c0, c1):
            ok = (r0 <= r1) & (c0 <= c1)
            r0, r1 = r0.clamp(0, nq - 1), r1.clamp(0, nq - 1)
            c0, c1 = c0.clamp(0, nkv - 1), c1.clamp(0, nkv - 1)
            n = c[r1 + 1, c1 + 1] - c[r0, c1 + 1] - c[r1 + 1, c0] + c[r0, c0]
            return torch.where(ok, n, torch.zeros_like(n))

        r0, r1 = torch.maximum(QA, KA), torch.minimum(QB, torch.full_like(QB, nq - 2))
        hit = rect(prefix2(a & stair), r0, r1, ka, kb)
        cells = rect(prefix2(stair), r0, r1, ka, kb)
        last = torch.nn.functional.pad(a[-1].long().cumsum(0), (1, 0))  # [nkv + 1]
        c1 = torch.minimum(KB, QB).clamp(max=nkv - 1)
        ok = torch.maximum(torch.maximum(QA, KA), torch.full_like(QA, nq - 1)) <= QB
        n_last = torch.where(ok, (c1 - ka + 1).clamp(min=0), torch.zeros_like(c1))
        hit_last = torch.where(ok & (ka <= c1), last[c1.clamp(min=0) + 1] - last[ka], torch.zeros_like(c1))
        hit, cells = hit + hit_last, cells + n_last
        return hit > 0, hit == cells


def block_sparse(block: int, allowed: Tensor) -> Pattern:
    """Block-sparse pattern on virtual positions: ``allowed[q // block, kv // block]``.

    Args:
        block: block size in virtual positions.
        allowed: BoolTensor [nq_blocks, nkv_blocks]; positions past the last block use the last
            row/column.
    """
    if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool or allowed.ndim != 2:
        raise ValueError("block_sparse: allowed must be a 2-D BoolTensor [nq_blocks, nkv_blocks]")
    if not is_int(block, 1):
        raise ValueError(f"block_sparse({block!r}, ...): block must be an int >= 1")
    if allowed.numel() == 0:
        raise ValueError(f"block_sparse: allowed has shape {tuple(allowed.shape)}; it needs at least one block")
    # a private copy: editing the caller's tensor later must not change cached block masks
    return _BlockSparse(block, allowed.detach().clone())


@dataclass(frozen=True, eq=False)
class _Callable(Pattern):
    frozen = False
    fn: Callable

    @property
    def __name__(self):
        return getattr(self.fn, "__name__", "user_pattern")

    # Two wrappers of one function are equal (block masks are cached by pattern); an unhashable
    # callable (e.g. a non-frozen dataclass instance) hashes by identity.
    def __eq__(self, other):
        return isinstance(other, _Callable) and (self.fn is other.fn or self.fn == other.fn)

    def __hash__(self):
        try:
            return hash(self.fn)
        except TypeError:
            return hash(("id", id(self.fn)))

    def __call__(self, q_pos, kv_pos):
        return self.check(self.fn(q_pos, kv_pos))

    def check(self, out):
        """``out`` if it is a bool tensor, else TypeError naming the pattern."""
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            kind = f"a {out.dtype} tensor" if isinstance(out, Tensor) else type(out).__name__
            raise TypeError(f"pattern {self.__name__!r} returned {kind}: a pattern must return a bool tensor "
                            "(True where q may attend to kv), e.g. `q_pos - kv_pos < 8`, not a number or a score")
        return out


def from_callable(fn: Callable) -> Pattern:
    """Wrap a user callable ``(q_pos, kv_pos) -> BoolTensor``. Its block bounds are conservative.

    The callable is tried once on a pair of 0-d positions, so that a non-bool result raises here
    rather than inside a compiled kernel (a callable that cannot take 0-d inputs is checked per call).
    """
    if isinstance(fn, Pattern):
        return fn
    p = _Callable(fn)
    zero = torch.zeros((), dtype=torch.long)
    try:
        probe = fn(zero, zero)
    except Exception:  # noqa: BLE001 -- e.g. needs other shapes; __call__ still checks every result
        return p
    p.check(probe)
    return p


@dataclass(frozen=True, eq=True)
class _And(Pattern):
    parts: tuple

    @property
    def frozen(self):
        return all(getattr(p, "frozen", False) for p in self.parts)

    @property
    def __name__(self):
        return "_and_".join(p.__name__ for p in self.parts)

    def __call__(self, q_pos, kv_pos):
        out = self.parts[0](q_pos, kv_pos)
        for p in self.parts[1:]:
            out = out & p(q_pos, kv_pos)
        return out

    def to_device(self, device):
        return _And(tuple(p.to_device(device) for p in self.parts))

    def bounds(self, *r):
        # "any" of a conjunction can only be bounded from above (conservative), "all" is exact
        b = [p.bounds(*r) for p in self.parts]
        any_, all_ = b[0]
        for a, l in b[1:]:
            any_, all_ = any_ & a, all_ & l
        return any_, all_


@dataclass(frozen=True, eq=True)
class _Or(Pattern):
    parts: tuple

    @property
    def frozen(self):
        return all(getattr(p, "frozen", False) for p in self.parts)

    @property
    def __name__(self):
        return "_or_".join(p.__name__ for p in self.parts)

    def __call__(self, q_pos, kv_pos):
        out = self.parts[0](q_pos, kv_pos)
        for p in self.parts[1:]:
            out = out | p(q_pos, kv_pos)
        return out

    def to_device(self, device):
        return _Or(tuple(p.to_device(device) for p in self.parts))

    def bounds(self, *r):
        b = [p.bounds(*r) for p in self.parts]
        any_, all_ = b[0]
        for a, l in b[1:]:
            any_, all_ = any_ | a, all_ | l
        return any_, all_


def all_of(*patterns) -> Pattern:
    """Pairs allowed by every pattern (logical and)."""
    if not patterns:
        raise ValueError("all_of() needs at least one pattern")
    return _And(tuple(_as_pattern(p) for p in patterns))


def any_of(*patterns) -> Pattern:
    """Pairs allowed by at least one pattern (logical or)."""
    if not patterns:
        raise ValueError("any_of() needs at least one pattern")
    return _Or(tuple(_as_pattern(p) for p in patterns))
