"""examples/real_checkpoint.py on a checkpoint saved to disk (tiny random Llama + a word-level tokenizer
with a chat template, built here; nothing is downloaded): end to end offline, and its grouped loss and
gradients against each [prompt; response] alone through a freshly loaded stock model."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import socket
import sys

import pytest
import torch

from _trainers import save_tiny_llama

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "real_checkpoint.py"
# words of the prompt, then the generation prompt "a" (the word tokenizer knows the letters a..z)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}a {% endif %}"


def _example():
    spec = importlib.util.spec_from_file_location("real_checkpoint", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from transformers import AutoTokenizer

    path = save_tiny_llama(tmp_path_factory.mktemp("checkpoint"))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def test_the_example_runs_offline_on_a_saved_checkpoint(checkpoint, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the example tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    ex = _example()
    assert ex.main(["--model", checkpoint, "--group-size", "3", "--max-new-tokens", "6", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    diff = float(re.search(r"check: grouped log-probs vs each \[prompt; response\] alone: max \|diff\| = (\S+)",
                           out).group(1))
    assert diff < 1e-5, out
    assert re.search(r"^step 2: mean reward \S+, loss \S+, tokens through the model (\d+) instead of (\d+)", out, re.M)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_the_examples_grpo_step_equals_each_sequence_alone(dtype, checkpoint, hf_oracle, precision_for):
    from transformers import AutoModelForCausalLM

    from flexgroup import GroupedBatch
    from flexgroup.train.grpo import group_advantages, policy_loss

    ctx, atol, rel = precision_for(dtype)
    ex = _example()
    model, tok = ex.load(checkpoint, dtype)
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").to(dtype)  # never patched
    prompts = [ex.prompt_ids(tok, q) for q, _ in ex.PROMPTS]
    assert all(p[-1] == tok.convert_tokens_to_ids("a") for p in prompts)  # the chat template was applied
    torch.manual_seed(0)
    responses = [ex.sample(model, tok, p, 3, 6) for p in prompts]
    rewards = torch.arange(6, dtype=dtype)  # distinct: every advantage nonzero
    adv = group_advantages(rewards, group_size=3)
    batch = GroupedBatch.from_groups(prompts, responses)
    mask = batch.response_mask
    with ctx:
        logp = ex.response_logprobs(model, batch)
        policy_loss(logp, logp.detach(), adv, mask).backward()
        _, ref = hf_oracle.run(stock, prompts, responses)
        ref_logp = torch.nn.utils.rnn.pad_sequence(ref, batch_first=True)
        policy_loss(ref_logp, ref_logp.detach(), adv, mask).backward()
    assert batch.layout.cost().grouped_tokens < batch.layout.cost().baseline_tokens
    assert (torch.where(mask, logp - ref_logp, 0).abs().max()) <= atol
    grads = hf_oracle.grads(model)
    assert max(g.abs().max() for g in grads.values()) > 0
    hf_oracle.assert_grads_close(grads, hf_oracle.grads(stock), rel)


def test_the_examples_check_catches_a_packed_row_without_the_grouped_mask(checkpoint, capsys, causal_over_packed_row):
    # the deliberately broken variant: responses see their siblings; the example's own check must show it
    assert _example().main(["--model", checkpoint, "--group-size", "3", "--max-new-tokens", "6"]) == 1
    out = capsys.readouterr().out
    assert float(re.search(r"max \|diff\| = (\S+)", out).group(1)) > 1e-3 and "equivalent: no" in out


def test_the_checkpoint_example_runs_with_no_arguments_on_a_built_in_tiny_checkpoint(capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the example tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    assert _example().main([]) == 0
    assert "equivalent: yes" in capsys.readouterr().out


def _load_script(name: str):
    path = EXAMPLE.parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_PROGRESS = re.compile(r"\d+%\|")  # a tqdm bar ("Writing model shards: 100%|####| 1/1 [...]")


def _own_lines(err: str) -> list[str]:
    """stderr without other libraries' progress bars (transformers / huggingface_hub print them where they like)."""
    return [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not _PROGRESS.search(line)]


@pytest.mark.parametrize("script", ["real_checkpoint", "trl_grpo"])
def test_the_examples_give_one_line_for_a_hub_id_not_in_the_cache(script, tmp_path, capsys, monkeypatch):
    if script == "trl_grpo":
        pytest.importorskip("trl")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert _load_script(script).main(["--model", "some-org/not-cached-model"]) == 2
    err = _own_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith(f"{script}.py: error: --model some-org/not-cached-model: "), err
    assert "never downloads" in err[0]


@pytest.mark.parametrize("script", ["real_checkpoint", "trl_grpo"])
def test_the_examples_give_one_line_for_a_checkpoint_without_its_tokenizer(script, tmp_path, capsys):
    if script == "trl_grpo":
        pytest.importorskip("trl")
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path)
    capsys.readouterr()  # what saving the fixture printed is not the script's
    assert _load_script(script).main(["--model", str(tmp_path)]) == 2
    err = _own_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith(f"{script}.py: error: "), err
    assert "the directory has no tokenizer" in err[0] and "tokenizer.save_pretrained" in err[0]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_scoring_example_matches_each_sequence_alone(dtype, capsys):
    assert _load_script("scoring").main(["--dtype", dtype]) == 0
    out = capsys.readouterr().out
    diffs = [float(d) for d in re.findall(r"alone: max \|diff\| = (\S+)", out)]
    assert len(diffs) == 2 and max(diffs) <= (1e-9 if dtype == "float64" else 1e-4), out
    tokens = re.search(r"reward model: (\d+) tokens through the model instead of (\d+)", out)
    assert int(tokens.group(1)) < int(tokens.group(2))
    assert "equivalent: yes" in out


def test_the_scoring_examples_check_catches_responses_that_see_their_siblings(capsys, causal_over_packed_row):
    assert _load_script("scoring").main(["--dtype", "float64"]) == 1
    out = capsys.readouterr().out
    assert "equivalent: no" in out
    assert max(float(d) for d in re.findall(r"alone: max \|diff\| = (\S+)", out)) > 1e-3


def test_the_dpo_example_trains_offline_and_shares_prompts(capsys, monkeypatch):
    trl = pytest.importorskip("trl")
    pytest.importorskip("datasets")
    if not hasattr(sys.modules[trl.DPOTrainer.__module__], "add_fused_lm_head"):  # e.g. TRL 0.20
        pytest.skip("this TRL's DPOTrainer runs concatenated_forward over full logits (no fused LM head): "
                    "flexgroup's DPO adapter does not cover it")

    def refuse(*args, **kwargs):
        raise AssertionError("the example tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    assert _load_script("dpo").main(["--steps", "1", "--pairs", "4", "--backend", "sdpa"]) == 0
    out = capsys.readouterr().out
    for role in ("policy", "ref"):
        m = re.search(rf"^{role}: (\d+) grouped tokens vs (\d+) stock", out, re.M)
        assert m and int(m.group(1)) < int(m.group(2)), out


@pytest.mark.slow
def test_the_lm_eval_example_runs_a_local_task_offline_and_matches_lm_evals_hf_model(capsys, monkeypatch):
    pytest.importorskip("lm_eval", reason='lm-evaluation-harness is not installed (pip install -e ".[eval]")')
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert _load_script("lm_eval_local").main([]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^hf: acc = \S+", out, re.M) and re.search(r"^flexgroup: acc = \S+", out, re.M)
    diff = float(re.search(r"max \|log-likelihood diff\| = (\S+)", out).group(1))
    assert diff <= 1e-4


# ---------------------------------------------------------------- the DPO example's own check
def _dpo_example_or_skip():
    trl = pytest.importorskip("trl")
    pytest.importorskip("datasets")
    if not hasattr(sys.modules[trl.DPOTrainer.__module__], "add_fused_lm_head"):  # e.g. TRL 0.20
        pytest.skip("this TRL's DPOTrainer has no fused LM head: flexgroup's DPO adapter does not cover it")
    return _load_script("dpo")


def test_the_dpo_example_checks_itself_against_each_row_alone(capsys):
    assert _dpo_example_or_skip().main(["--steps", "1", "--pairs", "4"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"^check: (\d+) rows \((\d+) packed tokens instead of (\d+)\), grouped log-probs vs each "
                  r"\[prompt; completion\] alone: max \|diff\| = (\S+)$", out, re.M)
    assert m, out
    assert int(m.group(1)) == 8 and int(m.group(2)) < int(m.group(3))  # 4 pairs: 8 rows, prompts shared
    assert float(m.group(4)) <= 1e-4 and "equivalent: yes" in out


def test_the_dpo_examples_check_fails_when_completions_see_each_other(capsys, causal_over_packed_row):
    # the deliberately broken variant: plain causal attention over the packed row; exit status 1
    assert _dpo_example_or_skip().main(["--steps", "1", "--pairs", "4", "--backend", "sdpa"]) == 1
    out = capsys.readouterr().out
    assert "equivalent: no" in out
    assert float(re.search(r"max \|diff\| = (\S+)", out).group(1)) > 1e-3


# ---------------------------------------------------------------- TRL's GRPO example: checks the trained policy
def test_the_trl_grpo_example_trains_and_checks_the_trained_policy(capsys):
    pytest.importorskip("trl")
    assert _load_script("trl_grpo").main(["--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^policy: (\d+) grouped tokens vs (\d+) stock", out, re.M) and "equivalent: yes" in out


def test_the_trl_grpo_examples_check_fails_when_completions_see_each_other(capsys, causal_over_packed_row):
    pytest.importorskip("trl")
    assert _load_script("trl_grpo").main(["--steps", "1", "--backend", "sdpa"]) == 1
    assert "equivalent: no" in capsys.readouterr().out


# ---------------------------------------------------------------- a missing extra: one line, exit 2
@pytest.mark.parametrize("script, module, extra", [("trl_grpo", "trl", "trl"), ("dpo", "trl", "trl"),
                                                   ("lm_eval_local", "lm_eval", "eval")])
def test_an_example_without_its_extra_names_the_install_command_in_one_line(script, module, extra, capsys,
                                                                             monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ModuleNotFoundError
    for name in [m for m in sys.modules if m.startswith("flexgroup.integrations.")]:
        monkeypatch.delitem(sys.modules, name)      # re-imported, so that they meet the missing module
    from flexgroup.integrations import EXTRAS

    assert _load_script(script).main([]) == 2
    err = _own_lines(capsys.readouterr().err)
    # the first missing module of the extra is named (datasets before trl where neither is installed)
    named = [m for m, e in EXTRAS.items() if e == extra]
    assert len(err) == 1 and any(err[0] == f'{script}.py: error: needs {m}, which is not installed: pip install -e '
                                 f'".[{extra}]" (in the flexgroup clone; flexgroup is not on a package index)'
                                 for m in named), err
