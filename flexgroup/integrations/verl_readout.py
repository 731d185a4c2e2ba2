"""The verl engine's readout: verl's ``model_output`` layout from a grouped forward's packed logits.

:class:`flexgroup.integrations.verl.FlexGroupFSDPEngine` (and its Ulysses path,
:mod:`flexgroup.integrations.verl_ulysses`) call :func:`model_output`: every sample's log-probs (and
entropies, ``sum_pi_squared`` where asked) read from the packed row, each distinct logit row scaled once
per distinct temperature, returned jagged like the micro-batch's ``input_ids`` -- verl's layout, value for
value, including the last entry of each sample (verl's rolled label: the first token of the next sample of
verl's own micro-batch, ``LAST_LABEL`` in a planned forward).
"""

from __future__ import annotations

import torch
import verl.utils.torch_functional as verl_F
from verl.utils import tensordict_utils as tu

from flexgroup.data.readout import read_plan, read_scores
from flexgroup.integrations.verl_plan import LAST_LABEL

__all__ = ["model_output", "entropy"]

Tensor = torch.Tensor


def model_output(engine, logits: Tensor, batch, mb) -> dict[str, Tensor]:
    """verl's ``model_output`` from the packed row's logits.

    Args:
        engine: the :class:`~flexgroup.integrations.verl.FlexGroupFSDPEngine` (its entropy settings).
        logits: [L, V], one row per packed token.
        batch: the grouped batch; ``batch.paths[i]`` [n_i] are sample ``i``'s packed indices.

    Returns:
        ``log_probs`` (and ``entropy`` / ``sum_pi_squared`` where the micro-batch asks for them):
        jagged [N, n_i] with the micro-batch's offsets, as verl's stock step returns them.
    """
    get = lambda key, default=False: tu.get_non_tensor_data(data=mb, key=key, default=default)  # noqa: E731
    want_entropy, want_pi2 = get("calculate_entropy"), get("calculate_sum_pi_squared")
    ids = mb["input_ids"]
    offsets, values = ids.offsets(), ids.values()
    lens = offsets.diff()
    n = lens.numel()
    rows = torch.cat(batch.paths).to(logits.device)                       # [T] packed row per token
    labels = torch.roll(values, shifts=-1, dims=0)                         # [T] verl's rolled labels
    if LAST_LABEL in mb.keys():  # a planned forward: the label verl's own micro-batch gives each last entry
        labels[offsets[1:] - 1] = mb[LAST_LABEL].to(labels.device)
    temperature = mb["temperature"]
    unit = not isinstance(temperature, Tensor) and float(temperature) == 1.0
    temps = (temperature if isinstance(temperature, Tensor) else torch.tensor([float(temperature)] * n))
    temps = temps.to(device=logits.device, dtype=torch.float32).reshape(-1)
    if temps.numel() != n:
        raise ValueError(f"flexgroup: temperature has {temps.numel()} entries for {n} samples")
    owner = torch.repeat_interleave(torch.arange(n, device=logits.device), lens.to(logits.device))
    work = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    outs: dict[str, list] = {"log_probs": [], "entropy": [], "sum_pi_squared": []}
    picks = []
    for tau in torch.unique(temps):
        sel = torch.nonzero(temps[owner] == tau)[:, 0]                     # [T_tau] tokens at this temperature
        if sel.numel() == rows.numel():
            x, r = logits, rows                                            # every row, in place
        else:
            used, r = torch.unique(rows[sel], return_inverse=True)
            x = logits.index_select(0, used)
        if not unit:
            x = x / tau.clamp(min=1e-8).to(x.dtype)
        lp, _ = read_scores(x, read_plan(r, labels[sel]), dtype=work)      # [T_tau], each distinct row once
        outs["log_probs"].append(lp)
        if want_entropy:
            outs["entropy"].append(entropy(engine, x)[r])
        if want_pi2:
            outs["sum_pi_squared"].append(verl_F.calculate_sum_pi_squared_from_logits(x)[r])
        picks.append(sel)
    order = torch.cat(picks)
    out = {}
    for key, parts in outs.items():
        if not parts:
            continue
        flat = torch.cat(parts)
        if len(picks) > 1:                                                 # back to verl's token order
            flat = torch.zeros_like(flat).index_put((order,), flat)
        out[key] = torch.nested.nested_tensor_from_jagged(flat, offsets)
    return out


def entropy(engine, x: Tensor) -> Tensor:
    """Entropy per row [rows] of logits ``x`` [rows, V], with the engine's own entropy settings."""
    cfg = engine.engine_config
    if cfg.entropy_checkpointing:
        return torch.utils.checkpoint.checkpoint(engine.compute_entropy_from_logits, x, use_reentrant=False)
    if cfg.entropy_from_logits_with_chunking:
        return engine.compute_entropy_from_logits(x, chunk_size=cfg.entropy_from_logits_chunk_size)
    return engine.compute_entropy_from_logits(x)
