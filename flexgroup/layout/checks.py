"""Input checks shared by every layer: integers, token ids, masks (one rule for all), loss masks (one home
each); and :func:`normal_tensors`, the one rule for tensors kept beyond a call. Checks of a model (PEFT unwrap,
meta weights) are :mod:`flexgroup.reference.model_checks`'.

Each check either returns the value in canonical form or raises ``ValueError`` naming the argument,
the bad value and the fix; callers that need their own wording use the predicate :func:`is_int`.
Pure Python and PyTorch, no flexgroup import (the bottom of the core layer).
"""

from __future__ import annotations

import functools
import numbers
from typing import Callable, Sequence

import torch

__all__ = ["is_int", "check_int", "check_temperature", "token_ids", "bool_mask", "loss_mask", "check_sequences",
           "check_loss_masks", "normal_tensors"]

Tensor = torch.Tensor


def is_int(value, minimum: int = 1) -> bool:
    """True when ``value`` is a Python ``int`` (not a ``bool``) and ``>= minimum``."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as an ``int`` (any integral number or 0-d integer tensor) ``>= minimum``, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point():
            value = int(value)
        else:
            raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value < minimum:
        what = "empty segments are not allowed" if minimum == 1 else f"must be >= {minimum}"
        raise ValueError(f"{name} = {value}: {what}")
    return value


def check_temperature(where: str, temperature) -> float:
    """``temperature`` as a float, else ValueError: a finite real number > 0 (logits are divided by it).

    A one-element tensor counts as its value, integer dtypes included (``torch.tensor(2)`` is 2.0); a bool or
    complex one is refused with its dtype named.
    """
    if isinstance(temperature, Tensor) and temperature.numel() == 1:
        if temperature.dtype == torch.bool or temperature.is_complex():
            raise ValueError(f"{where}: temperature must be a real number > 0, got a {temperature.dtype} tensor "
                             f"({temperature!r}); give a float, e.g. 1.0")
        temperature = temperature.item()  # a float or int, as the Python number would be
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not (
            0 < float(temperature) < float("inf")):
        raise ValueError(f"{where}: temperature must be > 0 and finite (logits are divided by it before the "
                         f"softmax), got {temperature!r}; use 1.0 for the model's own distribution")
    return float(temperature)


def token_ids(x, what: str) -> Tensor:
    """``x`` as a non-empty 1-D LongTensor of token ids on CPU, else ValueError naming ``what``."""
    x = torch.as_tensor(x)
    if x.ndim != 1 or x.is_floating_point() or x.dtype == torch.bool:
        raise ValueError(f"{what} must be a 1-D integer tensor of token ids, got shape {tuple(x.shape)} "
                         f"dtype {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"{what} is empty: every prompt, response and sequence needs at least one token")
    return x.long().cpu()


def bool_mask(m, what: str) -> Tensor:
    """The one rule for every mask argument (loss, attention, prompt, completion, tool masks): a bool
    tensor, or an integer or floating tensor whose values are all 0 or 1 (1 = True). Any other value
    is refused (a 2 is not silently True); Hugging Face ``labels`` (-100 on ignored tokens) are named.

    Returns the mask as a CPU BoolTensor of the same shape.
    """
    m = torch.as_tensor(m)
    if m.dtype == torch.bool:
        return m.cpu()
    if m.is_complex():
        raise ValueError(f"{what} has dtype {m.dtype}: give a bool mask (or 0/1 values)")
    bad = m[(m != 0) & (m != 1)]
    if bad.numel():
        seen = sorted(set(bad.unique().tolist()), key=str)[:4]
        hint = (" -- these look like Hugging Face labels (-100 on ignored tokens): pass `labels != -100`"
                if bool((bad == -100).any()) else "")
        raise ValueError(f"{what} holds values other than 0/1 ({', '.join(map(str, seen))}): give a bool mask "
                         f"(True where it applies){hint}")
    return m.cpu().bool()


def loss_mask(m, n: int, what: str) -> Tensor:
    """A loss mask for a sequence of ``n`` tokens: BoolTensor [n], checked (:func:`bool_mask`, False at 0,
    not all False)."""
    m = torch.as_tensor(m)
    if m.ndim != 1 or m.numel() != n:
        raise ValueError(f"{what} must be a 1-D bool (or 0/1) tensor of the sequence's length {n}, got "
                         f"shape {tuple(m.shape)} dtype {m.dtype}")
    m = bool_mask(m, what)
    if bool(m[0]):
        raise ValueError(f"{what} is True at position 0: the first token has no context to predict it from; "
                         "set it False")
    if not bool(m.any()):
        raise ValueError(f"{what} is all False: the sequence would contribute no log-prob; drop the sequence "
                         "or mark at least one token after the first")
    return m


def check_sequences(sequences) -> list[Tensor]:
    """A list of N 1-D token-id tensors (see :func:`token_ids`), else ValueError."""
    if isinstance(sequences, Tensor):
        raise ValueError("from_sequences takes a list of 1-D tensors, got one tensor of shape "
                         f"{tuple(sequences.shape)}: for a right-padded [N, L] batch use from_padded_sequences")
    seqs = list(sequences)
    if not seqs:
        raise ValueError("from_sequences: no sequences given (an empty list)")
    return [token_ids(x, f"sequence {i}") for i, x in enumerate(seqs)]


def check_loss_masks(loss_masks: Sequence | None, seqs: list[Tensor]) -> list[Tensor]:
    """One checked loss mask per sequence (default: every token but the first), else ValueError."""
    if loss_masks is None:
        if all(s.numel() == 1 for s in seqs):
            raise ValueError(f"from_sequences: all {len(seqs)} sequences have 1 token, so there is no log-prob to "
                             "read (a sequence's first token has no context): give sequences of 2 or more tokens")
        return [torch.arange(s.numel()) >= 1 for s in seqs]
    if isinstance(loss_masks, Tensor):
        raise ValueError("loss_masks must be a list of 1-D bool tensors (one per sequence), got one tensor")
    masks = list(loss_masks)
    if len(masks) != len(seqs):
        raise ValueError(f"{len(masks)} loss masks for {len(seqs)} sequences: give one per sequence")
    return [loss_mask(m, s.numel(), f"loss mask of sequence {i}") for i, (m, s) in enumerate(zip(masks, seqs))]


def normal_tensors(fn: Callable) -> Callable:
    """Decorator for builders of tensors that outlive the call (caches, plans, a batch's index tensors).

    Under ``torch.inference_mode()`` they would be inference tensors, which a later forward *with*
    gradients cannot save for backward ("Inference tensors cannot be saved for backward"): one scoring
    pass under inference mode would break every later training step on the same layout. ``fn`` runs
    with inference mode switched off, so what it builds serves both modes.
    """
    @functools.wraps(fn)
    def build(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False):
            return fn(*args, **kwargs)

    return build
