"""``flexgroup doctor``: what this installation supports, checked by running it.

Prints the versions of torch, transformers and the optional integrations, then, for every architecture
of the tiny-model zoo (:mod:`flexgroup.models.zoo`), whether ``flexgroup.patch`` supports it here: a tiny
float64 model is built, copied (the stock oracle), patched, and one grouped forward (a 6-token prompt,
responses of 3 and 2 tokens) is compared with each ``[prompt; response]`` run alone through the copy.
The run-time scans of Gated DeltaNet / Mamba2 hybrids compute in float32 even in a float64 model, so the
bound is float32-sized (1e-5 on log-probs); a broken fork is off by far more.

Each line says ``ok`` (with the error), ``refused`` (``patch``'s message: the cause and the fix),
``not declared here`` (the installed transformers is below what flexgroup declares for the architecture:
not a fault) or ``WRONG`` (patched but not equal: a bug to report). Exit status 1 when any architecture
declared here is refused or wrong.
"""

from __future__ import annotations

import importlib.metadata
import platform
import time

__all__ = ["BOUND", "check_arch", "versions", "run"]

BOUND = 1e-5  # log-probs, float64 models (hybrid scans run in float32 inside)
PACKAGES = ("torch", "transformers", "kernels", "trl", "peft", "accelerate", "verl")


def versions() -> list[tuple[str, str]]:
    """``(package, version or "not installed")`` for Python and :data:`PACKAGES`."""
    out = [("python", platform.python_version())]
    for name in PACKAGES:
        try:
            out.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            out.append((name, "not installed"))
    return out


def check_arch(arch: str) -> tuple[str, str]:
    """``(status, detail)`` for the tiny ``arch``: status ``ok``, ``refused``, ``not declared here`` or ``WRONG``."""
    import torch

    import flexgroup
    from flexgroup.models.zoo import build_model, unavailable
    from flexgroup.reference.oracle import logprobs_alone, own_copy

    if why := unavailable(arch):
        return "not declared here", why
    model = build_model(arch, dtype=torch.float64).eval()
    stock, _ = own_copy(model)
    try:
        flexgroup.patch(model)
    except (TypeError, ValueError, NotImplementedError) as e:
        return "refused", " ".join(str(e).split())
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (6,), generator=gen)
    responses = [torch.randint(0, vocab, (n,), generator=gen) for n in (3, 2)]
    batch = flexgroup.GroupedBatch.from_groups([prompt], [responses])
    with torch.no_grad():
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        err = 0.0
        for i, r in enumerate(responses):
            alone = logprobs_alone(stock, torch.cat([prompt, r]))[-len(r):]
            err = max(err, float((lp[i, : len(r)] - alone).abs().max()))
    if not err <= BOUND:
        return "WRONG", f"grouped log-probs differ from each sequence alone by {err:.1e} (bound {BOUND:.0e})"
    return "ok", f"log-probs within {err:.1e} of each sequence alone"


def run(print_=print) -> int:
    """Print the report; 0 when every architecture declared here is ``ok``, else 1."""
    import torch

    from flexgroup.models.zoo import ARCHS

    torch.set_num_threads(1)
    for name, version in versions():
        print_(f"{name:<13} {version}")
    print_("")
    print_("architecture       patch here          detail")
    bad = 0
    start = time.perf_counter()
    for arch in ARCHS:
        try:
            status, detail = check_arch(arch)
        except Exception as e:  # noqa: BLE001 -- one line per architecture; the report goes on
            status, detail = "WRONG", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        bad += status in ("refused", "WRONG")
        print_(f"{arch:<18} {status:<19} {detail}")
    print_("")
    print_(f"{len(ARCHS)} architectures in {time.perf_counter() - start:.0f} s; "
           + ("all declared ones supported" if not bad else
              f"{bad} declared here but refused or wrong: please report this output"))
    return 1 if bad else 0
