"""CI: the installed (non-editable) package works from outside the source tree.

Run as ``python /path/to/.ci/install_check.py SOURCE_ROOT`` from a directory outside the checkout,
with flexgroup installed from a wheel or an sdist. It fails (exit 1) when

- ``import flexgroup`` resolves to the checkout instead of the installed copy;
- any module of the source tree's ``flexgroup/`` is missing from the installed package (a subpackage
  left out of the wheel), or fails to import;
- the installed distribution lacks the source tree's LICENSE (``.dist-info/licenses/LICENSE``, the same
  text), or, given a third argument (a built wheel or sdist), that archive does not hold it;
- ``flexgroup.patch`` + ``flexgroup.verify`` on a tiny random Llama do not say "equivalent".

``python .ci/install_check.py SOURCE_ROOT [ARTIFACT]``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pathlib
import sys
import tarfile
import zipfile


def modules_under(root: pathlib.Path) -> set[str]:
    """Dotted names of every module of the package rooted at ``root`` (a folder named flexgroup)."""
    names = set()
    for f in root.rglob("*.py"):
        rel = f.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.add(".".join(parts))
    return names


def license_problem(source: pathlib.Path, artifact: pathlib.Path | None) -> str | None:
    """Why the installed distribution (and ``artifact``, a .whl or .tar.gz) lacks ``source/LICENSE``, or None."""
    text = (source / "LICENSE").read_text()
    dist = importlib.metadata.distribution("flexgroup")
    installed = dist.read_text("licenses/LICENSE")
    if installed != text:
        return ("the installed distribution has no licenses/LICENSE in its .dist-info" if installed is None else
                "the installed licenses/LICENSE differs from the source tree's LICENSE")
    if "LICENSE" not in (dist.metadata.get_all("License-File") or []):
        return "the installed metadata names no License-File: LICENSE"
    if artifact is None:
        return None
    if artifact.name.endswith(".whl"):
        with zipfile.ZipFile(artifact) as z:
            names = [n for n in z.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
            held = z.read(names[0]).decode() if names else None
    else:
        with tarfile.open(artifact) as t:
            names = [n for n in t.getnames() if n.count("/") == 1 and n.endswith("/LICENSE")]
            held = t.extractfile(names[0]).read().decode() if names else None
    if held != text:
        return f"{artifact.name} does not hold the source tree's LICENSE" + (" (it differs)" if held else "")
    return None


def main() -> int:
    source = pathlib.Path(sys.argv[1]).resolve()
    artifact = pathlib.Path(sys.argv[2]).resolve() if len(sys.argv) > 2 else None
    import flexgroup

    installed = pathlib.Path(flexgroup.__file__).resolve().parent
    if source in installed.parents or installed == source / "flexgroup":
        print(f"install check: flexgroup imported from the checkout ({installed}), not the install")
        return 1
    missing = sorted(modules_under(source / "flexgroup") - modules_under(installed))
    if missing:
        print(f"install check: {len(missing)} module(s) of the source tree are not installed: "
              + ", ".join(missing) + " (are they in a package that setuptools finds?)")
        return 1
    problem = license_problem(source, artifact)
    if problem:
        print(f"install check: {problem} (pyproject.toml: license-files = [\"LICENSE\"])")
        return 1
    optional = ("flexgroup.integrations.",)  # need their optional dependency (trl, lm-eval, ...)
    for name in sorted(modules_under(installed)):
        try:
            importlib.import_module(name)
        except ImportError as e:
            if name.startswith(optional) and not str(getattr(e, "name", "") or "").startswith("flexgroup"):
                print(f"install check: {name} skipped ({e})")
                continue
            print(f"install check: import {name} failed: {e!r}")
            return 1

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 64, (12,))
    responses = [torch.randint(0, 64, (n,)) for n in (3, 7, 1)]
    batch = flexgroup.GroupedBatch.from_groups([prompt], [responses])
    report = flexgroup.verify(model, batch)
    patched = flexgroup.patch(model)
    lp = batch.logprobs(patched(**batch.model_inputs()).logits)
    if not report.ok or lp.shape != (3, 7) or not torch.isfinite(lp).all():
        print(f"install check: verify on a tiny Llama failed:\n{report}")
        return 1
    print(f"install check: ok ({len(modules_under(installed))} modules from {installed}; "
          f"LICENSE shipped; verify: equivalent)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
