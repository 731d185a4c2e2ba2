"""Every shell snippet of README.md and every Python snippet of README.md and docs/*.md runs as pasted,
or says why not.

Shell blocks are split into commands (on newlines and ``&&``); ``flexgroup ...`` commands run in
process through :func:`flexgroup.cli.main` (parsed with ``shlex``, as a shell would) in a scratch
directory that holds ``./my-local-model`` (a tiny checkpoint saved there); other commands must match
an entry of ``SKIPPED_COMMANDS``. Python blocks run with ``exec`` in a fresh namespace that holds no
module (a snippet imports torch and flexgroup itself, as a reader pasting it must), only tiny
stand-ins, from ``SETUPS``, for the data the text around it takes as given (``model``, ``seqs``, ...).
A block that cannot run with tiny stand-ins (a real checkpoint, a GPU, a launcher, ``...``
placeholders) has the line ``<!-- not-run: the reason -->`` right above it; a new block that neither
runs nor says why fails here. Output blocks (no language) are compared with what the command prints
today.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"^<!-- not-run: (.+?) -->$")

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
    "python examples/trl_grpo.py": "TRL training; tests/integrations/test_trl.py covers the adapter",
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
    """(doc, line, body, the not-run reason or None) of every Python block of README.md and docs/*.md."""
    out = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for line, lang, body in blocks(doc):
            if lang == "python":
                above = NOT_RUN.match(lines[line - 2]) if line >= 2 else None
                out.append((str(doc.relative_to(ROOT)), line, body, above and above.group(1)))
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
    from flexgroup.bench.zoo import build_model

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


# ---------------------------------------------------------------- Python blocks: tiny stand-ins for given names
def _llama(tiny_model, **kw):
    return tiny_model("llama", torch.float32, **kw)


def _training_loop(tiny_model, groups) -> dict:
    G = 3
    prompts, responses = groups([(5, [3, 4, 2]), (7, [2, 5, 1])])
    rows = [(p, r) for p, rs in zip(prompts, responses) for r in rs]
    Lp, Lc = max(p.numel() for p, _ in rows), max(r.numel() for _, r in rows)
    prompt_ids, prompt_mask = torch.zeros(len(rows), Lp, dtype=torch.long), torch.zeros(len(rows), Lp, dtype=torch.long)
    completion_ids, completion_mask = (torch.zeros(len(rows), Lc, dtype=torch.long) for _ in range(2))
    for i, (p, r) in enumerate(rows):  # prompts left-padded, completions right-padded
        prompt_ids[i, Lp - p.numel():], prompt_mask[i, Lp - p.numel():] = p, 1
        completion_ids[i, :r.numel()], completion_mask[i, :r.numel()] = r, 1
    return dict(model=_llama(tiny_model), prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, G=G, rewards=torch.arange(6.0), old_logp=torch.zeros(6, Lc))


def _rollouts(tiny_model, groups) -> dict:
    import flexgroup

    (system,), _ = groups([(4, [])])
    seqs = [torch.cat([system, torch.tensor(t)]) for t in ([5, 6, 7], [5, 6, 8, 9], [10, 11])]
    masks = [torch.arange(s.numel()) >= 4 for s in seqs]
    L = max(s.numel() for s in seqs)
    input_ids, attention_mask = torch.zeros(3, L, dtype=torch.long), torch.zeros(3, L, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, :s.numel()], attention_mask[i, :s.numel()] = s, 1
    cm = attention_mask.clone()
    cm[:, :4] = 0
    return dict(model=flexgroup.patch(_llama(tiny_model)), seqs=seqs, masks=masks, input_ids=input_ids,
                attention_mask=attention_mask, cm=cm, tm=torch.ones_like(cm))


def _layouts(tiny_model, groups) -> dict:
    from flexgroup import Layout

    lay_a, lay_b = Layout.group(prefix_len=30, response_lens=[5, 6]), Layout.tree(parents=[-1, 0], lengths=[8, 4])
    L = lay_a.num_tokens + lay_b.num_tokens
    return dict(lay_a=lay_a, lay_b=lay_b, q=torch.randn(1, 4, L, 16), k=torch.randn(1, 2, L, 16),
                v=torch.randn(1, 2, L, 16))


def _scoring(tiny_model, groups) -> dict:
    import flexgroup
    from transformers import LlamaConfig, LlamaForSequenceClassification

    prompts, responses = groups([(6, [3, 2]), (4, [5])])
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_labels=2, pad_token_id=0)
    torch.manual_seed(0)
    return dict(reward_model=LlamaForSequenceClassification(cfg).eval(), prompts=prompts, responses=responses)


def _causal_scoring(tiny_model, groups) -> dict:
    prompts, responses = groups([(6, [3, 2]), (4, [5])])
    return dict(model=_llama(tiny_model), prompts=prompts, responses=responses)


def _multiple_choice(tiny_model, groups) -> dict:
    from flexgroup.bench.checkpoints import word_tokenizer

    (context_ids,), choices = groups([(6, [3, 1, 2, 4])])
    return dict(model=_llama(tiny_model), context_ids=context_ids, choice_a=choices[0][0], choice_b=choices[0][1],
                choice_c=choices[0][2], choice_d=choices[0][3], tok=word_tokenizer())


def _streaming_loop(tiny_model, groups) -> dict:
    given = _rollouts(tiny_model, groups)
    return dict(given, adv=torch.randn(len(given["seqs"])),
                optimizer=torch.optim.SGD(given["model"].parameters(), lr=1e-3))


# a unique substring of a Python block -> the stand-ins for the data it takes as given (never a module)
SETUPS = {
    "GroupedBatch.from_padded(prompt_ids": _training_loop,
    "GroupedBatch.from_sequences(seqs": _rollouts,
    "adv = torch.randn(len(seqs))": _rollouts,                  # README's streaming block (docs': optimizer.step())
    "Layout.pack([lay_a, lay_b])": _layouts,
    "flexgroup.score(reward_model": _scoring,
    "flexgroup.score(model, prompts, responses)": _causal_scoring,
    "multiple_choice(model, [(context_ids": _multiple_choice,
    "optimizer.step()": _streaming_loop,
    "return_entropy=True)": _rollouts,
}


def run_block(body: str, name: str, given: dict) -> dict:
    """``exec`` a snippet in a fresh namespace that holds only ``given`` (no modules); returns the namespace."""
    modules = sorted(k for k, v in given.items() if isinstance(v, types.ModuleType))
    assert not modules, f"stand-ins must be data, not modules ({modules}): the snippet imports what it uses"
    namespace = {"__name__": "__snippet__", **given}
    exec(compile(body, name, "exec"), namespace)  # noqa: S102 -- the docs' own code
    return namespace


PYTHON_BLOCKS = python_blocks()


@pytest.mark.parametrize("doc, line, body, not_run", PYTHON_BLOCKS, ids=[f"{d}:{n}" for d, n, _, _ in PYTHON_BLOCKS])
def test_python_snippets_run_as_pasted(doc, line, body, not_run, tiny_model, groups):
    if not_run:
        pytest.skip(f"not-run: {not_run}")
    setups = [fn for key, fn in SETUPS.items() if key in body]
    assert len(setups) <= 1, f"{doc}:{line}: more than one SETUPS key matches this block"
    namespace = run_block(body, f"{doc}:{line}", setups[0](tiny_model, groups) if setups else {})
    if "loss" in namespace:  # the training-loop snippets end in loss.backward()
        assert torch.isfinite(namespace["loss"]).all()
        assert any(p.grad is not None and p.grad.abs().max() > 0 for p in namespace["model"].parameters())


def test_a_snippet_that_does_not_import_torch_fails_here():
    """The deliberately broken variant: what the README's streaming block looked like before its fix."""
    with pytest.raises(NameError, match="'torch' is not defined"):
        run_block("mask = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)", "broken", {"masks": []})
    with pytest.raises(AssertionError, match="not modules"):
        run_block("pass", "broken", {"torch": torch})


def test_every_not_run_marker_sits_right_above_a_python_block_and_gives_a_reason():
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for i, text in enumerate(lines):
            if re.match(r"\s*<!--\s*not-run", text):  # a marker line (not prose that mentions one)
                assert NOT_RUN.match(text), f"{doc.name}:{i + 1}: write it as <!-- not-run: the reason -->"
                assert i + 1 < len(lines) and lines[i + 1] == "```python", \
                    f"{doc.name}:{i + 1}: a not-run marker must be the line right above a ```python block"
    assert sum(1 for *_, why in PYTHON_BLOCKS if why is None) >= 8  # most snippets do run


def test_every_setups_key_matches_exactly_one_block():
    for key in SETUPS:
        hits = [f"{d}:{n}" for d, n, body, _ in PYTHON_BLOCKS if key in body]
        assert len(hits) == 1, f"SETUPS key {key[:40]!r} matches {hits}"


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
    from flexgroup.bench.zoo import ARCHS
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
