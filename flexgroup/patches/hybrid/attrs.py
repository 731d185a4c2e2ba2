"""Gated DeltaNet mixers that hold their kernels as instance attributes (transformers 5.10-style).

Some transformers releases (5.10 measured; 5.24 does not) build ``Qwen3_5GatedDeltaNet`` /
``Qwen3NextGatedDeltaNet`` (and ``OlmoHybridGatedDeltaNet``, see below) with ``self.causal_conv1d_fn``
(``None`` without the causal-conv1d package: the forward then runs ``F.silu(self.conv1d(x)[..., :L])``
on its ``nn.Conv1d``) and
``self.chunk_gated_delta_rule`` (fla's kernel or the module's ``torch_chunk_gated_delta_rule``),
instead of calling module-level functions. Found by feature detection (:func:`supports`), this
module wraps those attributes on the mixer instance; the wrappers are the same pass-through ones
as :mod:`flexgroup.patches.hybrid.wrappers`' (idle outside a grouped mixer call):

- ``chunk_gated_delta_rule``: forked per segment (:func:`flexgroup.kernels.fork.forked_gated_delta`).
- ``causal_conv1d_fn`` when set: forked per segment; when ``None``: the ``conv1d`` module's forward
  answers, inside a grouped call, the forked causal conv ``[1, C, L]`` padded to ``[1, C, L + k - 1]``
  (the stock code slices the first ``L`` columns and applies its activation).
- OLMo-hybrid's torch ``OlmoHybridShortConvolution`` modules (``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``,
  used when fla is not installed): their forward answers ``(act_fn(forked conv), None)`` inside a
  grouped call. With fla installed they are fla's ``ShortConvolution``, which this does not
  recognise: ``patch`` then refuses the model.

:func:`uninstall` restores the attributes (``unpatch``).
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.nn.functional as F

from flexgroup.data.carrier import GroupedMask
from flexgroup.kernels.fork import forked_conv

from . import wrappers

__all__ = ["supports", "install", "uninstall", "keep_grouped_linear_mask"]

_SAVED = "_flexgroup_saved_attrs"


def _depthwise_causal(conv) -> bool:
    return (isinstance(conv, torch.nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels
            and conv.padding == (conv.kernel_size[0] - 1,))


def _short_convs(m: torch.nn.Module) -> list[str]:
    """Names of ``m``'s transformers-defined short convolutions (OLMo-hybrid's torch ``ShortConvolution``:
    an ``nn.Conv1d`` subclass whose ``forward(x [1, L, C], cache, use_precomputed)`` returns
    ``(act_fn(causal conv) [1, L, C], conv state)``); [] when any of its convs is another kind."""
    names = [n for n, c in m.named_children() if isinstance(c, torch.nn.Conv1d)]
    ok = names and all(_depthwise_causal(c := getattr(m, n)) and type(c) is not torch.nn.Conv1d
             and type(c).__module__ == type(m).__module__ and callable(getattr(c, "act_fn", None))
             and {"cache", "use_precomputed"} <= set(inspect.signature(type(c).forward).parameters) for n in names)
    return names if ok else []


def supports(m: torch.nn.Module, kind: str) -> bool:
    """Whether ``m`` (a Gated DeltaNet mixer) holds its conv and scan kernels as instance attributes (a
    ``chunk_gated_delta_rule`` and a ``causal_conv1d_fn`` beside a depthwise ``conv1d``, or short-convolution
    modules). Whether its forward runs them is decided by ``patch``'s probe, not here."""
    if kind != wrappers.GDN or not callable(getattr(m, "chunk_gated_delta_rule", None)):
        return False
    conv = getattr(m, "conv1d", None)
    if hasattr(m, "causal_conv1d_fn"):
        return type(conv) is torch.nn.Conv1d and _depthwise_causal(conv)
    return bool(_short_convs(m))


def _torch_causal_conv(x, weight, bias=None, activation=None, **kwargs):
    """``x`` [n, C, T], ``weight`` [C, 1, k] -> [n, C, T]: the stock ``nn.Conv1d`` (zero left pad), no activation."""
    k = weight.shape[-1]
    return F.conv1d(x, weight, bias, padding=k - 1, groups=x.shape[1])[..., : x.shape[-1]]


def _conv_module_forward(self, x):
    """Replacement ``forward`` of the mixer's ``nn.Conv1d``: ``x`` [1, C, L] -> [1, C, L + k - 1] when grouped."""
    fork = wrappers.ACTIVE.get()
    if fork is None:
        return torch.nn.Conv1d.forward(self, x)
    fork.hit("conv")
    k = self.kernel_size[0]
    plan = fork.plan(k, x, -1)
    out = forked_conv(_torch_causal_conv, plan, x, self.weight, self.bias, activation=None, conv_input=fork.conv_input)
    return F.pad(out, (0, k - 1))


def _short_conv_forward(self, hidden_states, cache=None, use_precomputed=False, **kwargs):
    """Replacement ``forward`` of a short convolution: ``x`` [1, L, C] -> ([1, L, C], None) when grouped."""
    fork = wrappers.ACTIVE.get()
    if fork is None:
        return type(self).forward(self, hidden_states, cache=cache, use_precomputed=use_precomputed, **kwargs)
    fork.hit("conv")
    x = hidden_states.transpose(1, 2)
    out = forked_conv(_torch_causal_conv, fork.plan(self.kernel_size[0], x, -1), x, self.weight, self.bias,
                      activation=None, conv_input=fork.conv_input)
    return self.act_fn(out).transpose(1, 2), None


def _keyword_conv(original):
    wrapped = wrappers.wrap_conv(original)

    def causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs):
        """Called as ``fn(x=[1, C, L], weight=[C, k], ...)`` -> [1, C, L] (forked inside a grouped call)."""
        return wrapped(x, weight, bias, activation=activation, **kwargs)

    return causal_conv1d_fn


def install(m: torch.nn.Module) -> None:
    """Wrap ``m``'s kernel attributes (idempotent)."""
    if _SAVED in m.__dict__:
        return
    saved = {"chunk_gated_delta_rule": m.chunk_gated_delta_rule}
    m.chunk_gated_delta_rule = wrappers.wrap_gated_delta(saved["chunk_gated_delta_rule"])
    short = _short_convs(m)
    if short and not hasattr(m, "causal_conv1d_fn"):
        for n in short:
            conv = getattr(m, n)
            conv.forward = types.MethodType(_short_conv_forward, conv)
    elif m.causal_conv1d_fn is not None:
        saved["causal_conv1d_fn"] = m.causal_conv1d_fn
        m.causal_conv1d_fn = _keyword_conv(saved["causal_conv1d_fn"])
    else:
        m.conv1d.forward = types.MethodType(_conv_module_forward, m.conv1d)
    m.__dict__[_SAVED] = saved


def uninstall(m: torch.nn.Module) -> None:
    saved = m.__dict__.pop(_SAVED, None)
    if saved is None:
        return
    for name, fn in saved.items():
        setattr(m, name, fn)
    for conv in m.children():
        if isinstance(conv, torch.nn.Conv1d):
            conv.__dict__.pop("forward", None)


def keep_grouped_linear_mask(lm: torch.nn.Module) -> None:
    """A language model that takes no mask dict builds its mixers' mask in ``_update_linear_attn_mask(mask,
    cache)``, which would compare the carrier with 1: a grouped carrier is passed on unchanged instead
    (an instance attribute; ``unpatch`` deletes it)."""
    if "_update_linear_attn_mask" in lm.__dict__:
        return
    stock = lm._update_linear_attn_mask

    def _update_linear_attn_mask(attention_mask, *args, **kwargs):
        return attention_mask if isinstance(attention_mask, GroupedMask) else stock(attention_mask, *args, **kwargs)

    lm._update_linear_attn_mask = _update_linear_attn_mask

