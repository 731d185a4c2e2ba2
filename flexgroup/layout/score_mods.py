"""score_mods on *virtual* positions: ``softcap``, ``alibi`` and user functions.

A score_mod has the FlexAttention signature ``(score, b, h, q_pos, kv_pos) -> score`` but receives
virtual positions (a token's index in its own root-to-leaf sequence). It must be elementwise torch
code (it also runs on broadcast tensors in the exact CPU backend). Constants are kept as 0-d tensors
so that changing a value does not recompile.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .checks import normal_tensors

__all__ = ["ScoreMod", "softcap", "alibi", "score_mod"]

Tensor = torch.Tensor


class ScoreMod:
    """A score_mod ``(score, b, h, q_pos, kv_pos) -> score`` on virtual positions.

    ``to(device)`` returns a copy whose constant tensors live on ``device`` (cached).
    """

    __name__ = "score_mod"
    frozen = False  # user score_mods and tensors given by the user may change

    def __init__(self):
        self._on: dict[str, "ScoreMod"] = {}

    def tensors(self) -> dict[str, Tensor]:
        return {}

    @normal_tensors  # cached
    def to(self, device) -> "ScoreMod":
        key = str(torch.device(device))
        if key not in self._on:
            clone = object.__new__(type(self))
            clone.__dict__.update(self.__dict__)
            clone._on = {}
            for k, v in self.tensors().items():
                setattr(clone, k, v.to(device))
            self._on[key] = clone
        return self._on[key]

    def __call__(self, score, b, h, q_pos, kv_pos):  # pragma: no cover - abstract
        raise NotImplementedError

    def check_heads(self, num_heads: int) -> None:
        """Raise ValueError if this score_mod cannot serve ``num_heads`` query heads."""

    def __repr__(self):
        return self.__name__


class _Softcap(ScoreMod):
    frozen = True  # its cap is a private 0-d tensor
    def __init__(self, cap: float):
        super().__init__()
        self.cap = torch.tensor(float(cap), dtype=torch.float64)
        self.__name__ = f"softcap_{float(cap):g}"

    def tensors(self):
        return {"cap": self.cap}

    def __call__(self, score, b, h, q_pos, kv_pos):
        cap = self.cap.to(score.dtype)
        return cap * torch.tanh(score / cap)


def softcap(cap: float) -> ScoreMod:
    """Attention-logit softcapping ``cap * tanh(score / cap)`` (Gemma 2 ``attn_logit_softcapping``)."""
    if isinstance(cap, bool) or not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap({cap!r}): the cap must be a finite positive number (cap * tanh(score / cap); "
                         "for no softcapping pass no score_mod)")
    return _Softcap(cap)


class _Alibi(ScoreMod):
    def __init__(self, slopes: Tensor):
        super().__init__()
        self.slopes = slopes
        self.__name__ = f"alibi_{slopes.numel()}h"

    def tensors(self):
        return {"slopes": self.slopes}

    def __call__(self, score, b, h, q_pos, kv_pos):
        return score + self.slopes[h].to(score.dtype) * (kv_pos - q_pos).to(score.dtype)

    def check_heads(self, num_heads):
        # a compiled GPU kernel would read past the slopes silently: refuse up front
        if self.slopes.numel() != num_heads:
            raise ValueError(f"alibi has {self.slopes.numel()} slopes but the attention has {num_heads} "
                             "query heads: give one slope per query head")


def alibi(slopes) -> ScoreMod:
    """ALiBi bias ``score + slopes[h] * (kv_pos - q_pos)`` on virtual positions.

    Args:
        slopes: FloatTensor [Hq] (or a list), one slope per query head.
    """
    slopes = torch.as_tensor(slopes, dtype=torch.float32)
    if slopes.ndim != 1 or slopes.numel() == 0:
        raise ValueError(f"alibi: slopes must be a 1-D list/tensor of one slope per head, got shape {tuple(slopes.shape)}")
    return _Alibi(slopes)


class _UserScoreMod(ScoreMod):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "user_score_mod")

    def __call__(self, score, b, h, q_pos, kv_pos):
        return self.fn(score, b, h, q_pos, kv_pos)


def score_mod(fn: Callable) -> ScoreMod:
    """Wrap a user score_mod ``(score, b, h, q_pos, kv_pos) -> score`` (virtual positions)."""
    return fn if isinstance(fn, ScoreMod) else _UserScoreMod(fn)
