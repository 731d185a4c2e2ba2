"""``flexgroup doctor``: what this installation supports, checked by running it.

Prints the versions of torch, transformers and the optional integrations, then, for every architecture
of the tiny-model zoo (:mod:`flexgroup.models.zoo`: ``ARCHS`` and the vision-language ``VL_ARCHS``:
Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5), whether ``flexgroup.patch`` supports it here: a tiny float64
model is built, copied (the stock oracle), patched, and one grouped forward (a 6-token prompt, responses
of 3 and 2 tokens) is compared with each ``[prompt; response]`` run alone through the copy. A
vision-language model's prompt holds an image (3 text tokens, the image's 4 placeholders between its
start and end tokens, 2 text tokens): the grouped forward is a :class:`~flexgroup.data.multimodal.
MultimodalGroupedBatch` (M-RoPE from the model's rope index, the vision tower once), the copy gets each
sequence's own visual inputs (``MultimodalGroupedBatch.sequence_inputs``).
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

__all__ = ["BOUND", "architectures", "check_arch", "versions", "run"]

BOUND = 1e-5  # log-probs, float64 models (hybrid scans run in float32 inside)
PACKAGES = ("torch", "transformers", "kernels", "trl", "peft", "accelerate", "verl")
_PATCH = 3 * 2 * 2 * 2   # one patch row: channels x temporal patch x patch x patch


def architectures() -> tuple[str, ...]:
    """Every architecture doctor checks: the zoo's text models, then its vision-language ones."""
    from flexgroup.models.zoo import ARCHS, VL_ARCHS

    return ARCHS + tuple(VL_ARCHS)


def versions() -> list[tuple[str, str]]:
    """``(package, version or "not installed")`` for Python and :data:`PACKAGES`."""
    out = [("python", platform.python_version())]
    for name in PACKAGES:
        try:
            out.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            out.append((name, "not installed"))
    return out


def _batch(arch: str, model):
    """``(batch, prompt, responses, alone)``: one group (the prompt, responses of 3 and 2 tokens) packed as doctor
    checks ``arch``; ``alone(i)``: the keyword arguments that run sequence ``i`` alone through the stock copy."""
    import torch

    import flexgroup
    from flexgroup.data.multimodal import MultimodalGroupedBatch
    from flexgroup.models.zoo import VL_ARCHS, VL_END, VL_IMAGE, VL_START

    gen = torch.Generator().manual_seed(0)
    if arch not in VL_ARCHS:
        vocab = model.config.vocab_size
        prompt = torch.randint(0, vocab, (6,), generator=gen)
        responses = [torch.randint(0, vocab, (n,), generator=gen) for n in (3, 2)]
        return flexgroup.GroupedBatch.from_groups([prompt], [responses]), prompt, responses, lambda i: {}
    text = lambda n: torch.randint(3, 100, (n,), generator=gen)  # noqa: E731 -- ordinary tokens, below 120-123
    prompt = torch.cat([text(3), torch.tensor([VL_START] + [VL_IMAGE] * 4 + [VL_END]), text(2)])   # a 4x4-patch image: 4 tokens
    image = dict(pixel_values=torch.randn(16, _PATCH, generator=gen, dtype=torch.float64),
                 image_grid_thw=torch.tensor([[1, 4, 4]]))
    responses = [text(n) for n in (3, 2)]
    batch = MultimodalGroupedBatch.from_groups([prompt], [responses], model=model, vision=[image])
    return batch, prompt, responses, batch.sequence_inputs


def check_arch(arch: str) -> tuple[str, str]:
    """``(status, detail)`` for the tiny ``arch`` (:func:`architectures`): status ``ok``, ``refused``,
    ``not declared here`` or ``WRONG``."""
    import torch

    import flexgroup
    from flexgroup.models.zoo import VL_ARCHS, build_model, build_vl_model, unavailable
    from flexgroup.reference.oracle import logprobs_alone, own_copy

    if why := unavailable(arch):
        return "not declared here", why
    model = build_vl_model(arch, torch.float64) if arch in VL_ARCHS else build_model(arch, dtype=torch.float64).eval()
    stock, _ = own_copy(model)
    try:
        flexgroup.patch(model)
    except (TypeError, ValueError, NotImplementedError) as e:
        return "refused", " ".join(str(e).split())
    batch, prompt, responses, alone_inputs = _batch(arch, model)
    with torch.no_grad():
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        err = 0.0
        for i, r in enumerate(responses):
            alone = logprobs_alone(stock, torch.cat([prompt, r]), **alone_inputs(i))[-len(r):]
            err = max(err, float((lp[i, : len(r)] - alone).abs().max()))
    if not err <= BOUND:
        return "WRONG", f"grouped log-probs differ from each sequence alone by {err:.1e} (bound {BOUND:.0e})"
    return "ok", f"log-probs within {err:.1e} of each sequence alone"


def run(print_=print) -> int:
    """Print the report; 0 when every architecture declared here is ``ok``, else 1."""
    import torch

    archs = architectures()
    torch.set_num_threads(1)
    for name, version in versions():
        print_(f"{name:<13} {version}")
    print_("")
    print_("architecture       patch here          detail")
    bad = 0
    start = time.perf_counter()
    for arch in archs:
        try:
            status, detail = check_arch(arch)
        except Exception as e:  # noqa: BLE001 -- one line per architecture; the report goes on
            status, detail = "WRONG", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        bad += status in ("refused", "WRONG")
        print_(f"{arch:<18} {status:<19} {detail}")
    print_("")
    print_(f"{len(archs)} architectures in {time.perf_counter() - start:.0f} s; "
           + ("all declared ones supported" if not bad else
              f"{bad} declared here but refused or wrong: please report this output"))
    return 1 if bad else 0
