"""Every shell snippet of README.md and every Python snippet of README.md and docs/*.md runs as pasted,
or says visibly why not.

Shell blocks are split into commands (on newlines and ``&&``); ``flexgroup ...`` commands run in
process through :func:`flexgroup.cli.main` (parsed with ``shlex``, as a shell would) in a scratch
directory that holds ``./my-local-model`` (a tiny checkpoint saved there); other commands must match
an entry of ``SKIPPED_COMMANDS``. Python blocks run alone with ``exec`` in a fresh namespace that holds
nothing: a snippet imports torch and flexgroup and builds its own tiny model and data, as a reader pasting
it into a new interpreter must (in process, for speed: one import of torch for all blocks). A block that
cannot run here (a GPU, a download, a launcher, a package outside the test extra) starts with the visible
line ``# needs: <what>`` and is skipped with that reason. Output blocks (no language) are compared with what
the command prints today."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
NEEDS = re.compile(r"^# needs: (.+)$", re.M)

# command prefix -> why the test does not run it
SKIPPED_COMMANDS = {
    "git clone": "network / another repository: the README's fresh-clone run was done by hand",
    "cd ": "changes into the fresh clone (the scratch directory stands in for it)",
    "python3 -m venv": "creates a virtual environment (the suite already runs inside one)",
    "source ": "activates that environment",
    "pip install": "installs packages (network, minutes); CI's .ci/run does it",
    "python -m pytest -q": "the whole suite, which contains this test",
    "tox ": "builds whole test environments (downloads torch builds); CI runs tox -e oldest",
    "flexgroup demo": "the default demo takes 30-45 s of CPU time; tests/cli/test_cli.py runs it at tiny sizes",
    "flexgroup bench": "benchmarks take minutes; tests/cli/test_cli.py checks the hook",
    "python examples/real_checkpoint.py": "tests/docs/test_examples.py runs it on a saved tiny checkpoint",
    "python examples/trl_grpo.py": "tests/docs/test_examples.py runs it (with TRL installed)",
    "python examples/dpo.py": "tests/docs/test_examples.py runs it",
    "python examples/scoring.py": "tests/docs/test_examples.py runs it",
    "python examples/lm_eval_local.py": "tests/docs/test_examples.py runs it",
    "hf download": "downloads a checkpoint (network)",
}



def blocks(doc: pathlib.Path = README) -> list[tuple[int, str, str]]:
    """(line, language, body) of every fenced block of ``doc``."""
    text = doc.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def python_blocks() -> list[tuple[str, int, str, str | None]]:
    """(doc, line, body, what it needs or None) of every Python block of README.md and docs/*.md; a block
    that cannot run here starts with a visible line ``# needs: <what>`` (a GPU, a download, a launcher)."""
    out = []
    for doc in DOCS:
        for line, lang, body in blocks(doc):
            if lang == "python":
                needs = NEEDS.match(body)
                out.append((str(doc.relative_to(ROOT)), line, body, needs and needs.group(1).strip()))
    return out


def commands(body: str) -> list[str]:
    """The commands of a shell block: comments dropped, lines joined on ``\\``, split on ``&&``."""
    body = re.sub(r"\\\n", " ", body)
    out = []
    for line in body.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        out += [c.strip() for c in line.split("&&") if c.strip()]
    return out


SHELL = [(line, c) for line, lang, body in blocks() if lang in ("bash", "sh", "shell") for c in commands(body)]


def _skip_reason(command: str) -> str | None:
    if "--device cuda" in command and not torch.cuda.is_available():
        return "needs a CUDA device"
    return next((why for prefix, why in SKIPPED_COMMANDS.items() if command.startswith(prefix)), None)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A working directory holding ./my-local-model (tiny random Llama, saved with save_pretrained)."""
    from flexgroup.models.zoo import build_model

    build_model("llama").save_pretrained(tmp_path / "my-local-model")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("line, command", SHELL, ids=[f"line{line}:{c[:40]}" for line, c in SHELL])
def test_shell_commands_run_as_written(line, command, scratch, capsys):
    why = _skip_reason(command)
    if why:
        pytest.skip(why)
    argv = shlex.split(command)
    assert argv[0] == "flexgroup", f"README line {line}: {command!r} is neither run here nor in SKIPPED_COMMANDS"
    from flexgroup.cli import main

    status = main(argv[1:])
    captured = capsys.readouterr()
    assert status == 0, f"README line {line}: {command!r} exited {status}\n{captured.out}\n{captured.err}"


# ---------------------------------------------------------------- Python blocks: run as pasted
def run_block(body: str, name: str) -> dict:
    """``exec`` a snippet in a fresh namespace (no names given: it imports and builds what it uses, as a reader
    pasting it into a new interpreter must), with the global RNG seeded and restored; returns the namespace."""
    namespace = {"__name__": "__snippet__"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        exec(compile(body, name, "exec"), namespace)  # noqa: S102 -- the docs' own code
    return namespace


PYTHON_BLOCKS = python_blocks()


@pytest.mark.parametrize("doc, line, body, needs", PYTHON_BLOCKS, ids=[f"{d}:{n}" for d, n, _, _ in PYTHON_BLOCKS])
def test_python_snippets_run_as_pasted(doc, line, body, needs):
    if needs:
        pytest.skip(f"needs: {needs}")
    namespace = run_block(body, f"{doc}:{line}")
    if "loss" in namespace and isinstance(namespace["loss"], torch.Tensor):  # a training snippet: loss.backward()
        assert torch.isfinite(namespace["loss"]).all()
        assert any(p.grad is not None and p.grad.abs().max() > 0 for p in namespace["model"].parameters())


def test_a_snippet_that_uses_a_name_it_did_not_define_fails_here():
    """The deliberately broken variants: a block that takes ``model`` or ``torch`` as given."""
    with pytest.raises(NameError, match="'torch' is not defined"):
        run_block("mask = torch.ones(3)", "broken")
    with pytest.raises(NameError, match="'model' is not defined"):
        run_block("import torch\nout = model(torch.ones(1, 3, dtype=torch.long))", "broken")


def test_no_block_is_hidden_from_the_test_and_every_needs_line_says_what():
    for doc in DOCS:
        text = doc.read_text()
        assert "<!-- not-run" not in text, f"{doc.name}: a hidden not-run marker; make the block run, or start it " \
                                           "with a visible `# needs: <what>` line"
    for doc, line, body, needs in PYTHON_BLOCKS:
        assert needs is None or len(needs.split()) >= 2, f"{doc}:{line}: `# needs:` names what the block needs"
    assert sum(1 for *_, needs in PYTHON_BLOCKS if needs is None) >= 9  # the README and docs snippets that run today


def test_the_quickstart_trains_with_from_groups_against_each_sequence_alone():
    quick = next(body for doc, _, body, _ in PYTHON_BLOCKS if doc == "README.md")
    for needed in ("build_model(", "copy.deepcopy(model)", "flexgroup.patch(model)", "GroupedBatch.from_groups(",
                   "old_logp", "policy_loss(", "loss.backward()", "torch.allclose("):
        assert needed in quick, f"README's first Python block lacks {needed}"


def test_the_readmes_demo_output_has_the_rows_the_demo_prints(capsys):
    """The pasted `flexgroup demo` output shows the rows and summary lines that the demo prints today."""
    from flexgroup.cli import main

    pasted = next((body for _, lang, body in blocks() if not lang and "equivalent:" in body), None)
    assert pasted is not None, "README.md has no pasted flexgroup demo output"
    assert main(["demo", "--size", "tiny", "--prefix-len", "16", "--group-size", "2", "--response-len", "4"]) == 0
    out = capsys.readouterr().out
    labels = lambda text: {line[:23].strip() for line in text.splitlines()  # noqa: E731 -- the table's first column
                           if re.match(r"^[a-z]", line) and ":" not in line[:23]}
    assert labels(pasted) == labels(out), (labels(pasted), labels(out))
    for start in ("flexgroup demo:", "batch:", "loss:", "equivalent:", "speedup:"):
        assert any(line.startswith(start) for line in pasted.splitlines()), start


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_architecture_table_lists_every_architecture_flexgroup_offers():
    from flexgroup.models.zoo import ARCHS
    from flexgroup.patches import HYBRIDS, REGISTRY

    table = _section("Supported architectures")
    missing = [a for a in sorted({*ARCHS, *REGISTRY, *HYBRIDS}) if not re.search(rf"`{a}`|\b{a}\b", table)]
    assert not missing, f"README's architecture table omits {missing}"


def test_the_readme_names_every_backend():
    from flexgroup.kernels import BACKEND_NAMES

    assert all(f'`"{b}"`' in README.read_text() for b in BACKEND_NAMES), BACKEND_NAMES


def test_the_demo_time_reads_the_same_in_the_readme_and_in_demo_help():
    from flexgroup.cli import build_parser

    demo = next(a for a in build_parser()._actions if a.dest == "command").choices["demo"]
    stated = re.search(r"(\d+-\d+ s) of CPU time", demo.description)
    row = next(line for line in README.read_text().splitlines() if line.startswith("| `flexgroup demo` |"))
    assert stated and re.search(r"(\d+-\d+ s) of CPU time", row), (demo.description, row)
    assert re.search(r"(\d+-\d+ s) of CPU time", row).group(1) == stated.group(1)
