"""Discovery of stateful token mixers in a decoder's layers (for :mod:`flexgroup.patches.hybrid`).

A mixer is recognised by its class name (Mamba, DeltaNet, RWKV, ShortConv, linear attention, ...,
without the model-type prefix) or by a causal depthwise ``Conv1d`` it holds.
"""

from __future__ import annotations

import torch

__all__ = ["stateful_modules"]

_STATEFUL_NAME = ("mamba", "deltanet", "deltaattention", "rwkv", "shortconv", "lightning", "recurrent", "linearattn",
                  "linearattention", "mixer", "retention", "hyena", "mlstm", "slstm", "ssm")


def _causal_depthwise_conv(m: torch.nn.Module) -> bool:
    return (isinstance(m, torch.nn.Conv1d) and m.groups == m.in_channels == m.out_channels and m.kernel_size[0] > 1
            and m.padding == (m.kernel_size[0] - 1,))


def stateful_modules(lm: torch.nn.Module) -> list[tuple[int, str, torch.nn.Module]]:
    """``(layer index, class name, module)`` of every token mixer in ``lm.layers`` that carries state.

    Found by class name without the model-type prefix (Mamba, DeltaNet, RWKV, ShortConv, linear
    attention, ...) or by a causal depthwise ``Conv1d`` (``groups == channels``, ``padding ==
    kernel - 1``), reported as the module holding it. Outermost match per subtree.
    """
    found = []
    prefix = str(getattr(lm.config, "model_type", "")).replace("_", "").lower()  # "KimiLinearAttention" is not linear
    for i, layer in enumerate(lm.layers):
        seen: list[str] = []
        for name, m in layer.named_modules():
            if any(name == s or name.startswith(s + ".") for s in seen):
                continue
            cls = type(m).__name__.lower().replace("_", "")
            cls = cls[len(prefix):] if prefix and cls.startswith(prefix) else cls
            if name and any(k in cls for k in _STATEFUL_NAME):
                found.append((i, type(m).__name__, m))
                seen.append(name)
            elif _causal_depthwise_conv(m):
                owner = name.rpartition(".")[0]
                holder = layer.get_submodule(owner) if owner else layer
                found.append((i, type(holder).__name__, holder))
                seen.append(owner or name)
    return found
