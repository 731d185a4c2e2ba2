"""The repeated baseline, one definition: each sequence run alone through a stock (unpatched) model.

Shared by ``flexgroup.verify``, the generic path's self-check, the CLI and the benchmarks. It calls
the model exactly as a user would for one sequence (``input_ids [1, S]``, no mask, no cache), so it
knows nothing of flexgroup's layouts: the grouped result is compared with this, never with itself.

No transformers import here (the model is whatever the caller passes).
"""

from __future__ import annotations

import torch

__all__ = ["logits_alone", "logprobs_alone", "logprobs_of"]


def logits_alone(model: torch.nn.Module, sequence: torch.Tensor, **kwargs) -> torch.Tensor:
    """Logits [S, V] of ``sequence`` (LongTensor [S]) run alone, on the model's device.

    ``kwargs`` go to the model (e.g. vision inputs); ``use_cache=False`` always.
    """
    device = next(model.parameters()).device
    return model(input_ids=sequence[None].to(device), use_cache=False, **kwargs).logits[0]


def logprobs_alone(model: torch.nn.Module, sequence: torch.Tensor, temperature: float = 1.0,
                   **kwargs) -> torch.Tensor:
    """Log-probs [S - 1]: entry ``t - 1`` is ``log p(sequence[t] | sequence[:t])`` (in at least float32)."""
    return logprobs_of(logits_alone(model, sequence, **kwargs), sequence, temperature)


def logprobs_of(logits: torch.Tensor, sequence: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [S - 1] of ``sequence`` [S] from its own logits [S, V] (the last row unused), in at
    least float32: entry ``t - 1`` is ``log p(sequence[t] | sequence[:t])``."""
    logits = logits[:-1]
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, sequence[1:, None].to(lp.device))[:, 0]
