"""Whether flexgroup forks a hybrid mixer exactly on the installed transformers: decided by running it.

``patch`` does not read transformers' source to decide. It runs each mixer class once, grouped, on a
tiny packed row (:func:`probe`): the forked conv and scan must both run (else
:class:`~flexgroup.patches.hybrid.wrappers.BypassedFork`) and every sequence must equal the stock forward
run on it alone. A mixer that fails is refused with :func:`cannot_fork`, which names the installed
versions, what the mixer did and a fix that is true for them.
"""

from __future__ import annotations

from typing import Callable

import torch

from flexgroup.data.carrier import GroupedMask
from flexgroup.layout import Layout

from .wrappers import BypassedFork

__all__ = ["probe", "cannot_fork", "kernelized", "tolerance"]


def cannot_fork(spec, mixer: str, finding: str) -> TypeError:
    """The refusal of ``patch`` for a mixer it cannot fork (``spec``: a ``HybridArchSpec``; ``mixer``: its class
    name; ``finding``: what the mixer did): the installed versions, the finding and the fix."""
    import transformers  # noqa: PLC0415
    from packaging.version import Version  # noqa: PLC0415  (a transformers dependency)

    installed = transformers.__version__
    if Version(installed) < Version(spec.forks_since):
        fix = (f"flexgroup forks {spec.model_type} on transformers {spec.forks_since} and later: "
               f"pip install -U 'transformers>={spec.forks_since}', or run this model without grouping")
    else:
        fix = (f"flexgroup forks {spec.model_type} on the transformers releases in docs/compatibility.md "
               f"({spec.forks_since} and later, as tested); this release changed the mixer in a way flexgroup does "
               "not handle yet: please report it with the output of `flexgroup doctor`. Meanwhile run this model "
               "without grouping, or install a tested transformers")
    return TypeError(f"flexgroup.patch: {spec.model_type}: transformers {installed} (torch {torch.__version__}), "
                     f"{mixer}: {finding}, so flexgroup cannot fork its state exactly at response boundaries. {fix}")


def kernelized(m: torch.nn.Module) -> list[str]:
    """Names of the declared functions (and the layer itself) that ``kernels.kernelize`` replaced on ``m``."""
    funcs = m.__dict__.get("_kernel_funcs", {})
    names = [n for n, f in funcs.items() if "_kernel_repo" in getattr(f, "__dict__", {})]
    return names + ([type(m).__name__] if "_kernel_repo" in m.__dict__ else [])


def tolerance(dtype: torch.dtype) -> float:
    """The probe's bound, relative to the largest output: rounding of the dtype, far below a leaked state."""
    return 5e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-3


def probe(m: torch.nn.Module, hidden_size: int, grouped: Callable, alone: Callable) -> str | None:
    """Run mixer ``m`` grouped on a tiny packed row and compare each sequence with it run alone.

    The row: a 5-token prompt and responses of 3 and 4 tokens (the conv window straddles both response
    starts); hidden states [1, 12, hidden_size] drawn from a fixed seed, in ``m``'s dtype and device.

    Args:
        grouped: ``(x [1, L, H], mask GroupedMask) -> [1, L, H]``, the patched grouped mixer call (raises
            BypassedFork when the forward did not run every forked kernel).
        alone: ``x [1, S, H] -> [1, S, H]``, the mixer's forward before ``patch``.

    Returns:
        None when the mixer forks exactly (within :func:`tolerance` of the largest output: a leaked state
        is off by the outputs' own size), else what went wrong. Also None, without running, for parameters
        that cannot compute here (meta, fake or distributed tensors): the run-time guards still hold there.
    """
    params = list(m.parameters())
    if not params or any(type(p) not in (torch.nn.Parameter, torch.Tensor) or p.device.type == "meta" for p in params):
        return None
    if torch._guards.detect_fake_mode() is not None:
        return None
    dtype, device = params[0].dtype, params[0].device
    layout = Layout.group(prefix_len=5, response_lens=[3, 4])
    x = torch.randn(1, layout.num_tokens, hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x.to(device=device, dtype=dtype)
    with torch.no_grad():
        try:
            out = grouped(x, GroupedMask(layout, device))
        except BypassedFork as e:
            swapped = kernelized(m)
            via = f"; kernels.kernelize replaced {swapped} on it" if swapped else ""
            return (f"its forward did not run all of its state through the functions flexgroup forks (forked "
                    f"conv ran: {'conv' in e.ran}, forked scan ran: {'scan' in e.ran}){via}")
        worst = 0.0
        for path in layout.paths():
            ref = alone(x[:, path])
            scale = float(ref.abs().max()) or 1.0
            worst = max(worst, float((out[:, path] - ref).abs().max()) / scale)
    if not worst <= tolerance(dtype):
        return (f"its grouped output differs from each sequence run alone by {worst:.2e} of the largest output "
                f"(bound {tolerance(dtype):.0e}): a state it carries is not one flexgroup forks")
    return None
