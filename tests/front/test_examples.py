"""examples/real_checkpoint.py on a checkpoint saved to disk (tiny random Llama + a word-level tokenizer
with a chat template, built here; nothing is downloaded): end to end offline, and its grouped loss and
gradients against each [prompt; response] alone through a freshly loaded stock model."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import socket

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
    from flexgroup.grpo import group_advantages, policy_loss

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
    assert _example().main(["--model", checkpoint, "--group-size", "3", "--max-new-tokens", "6"]) == 0
    diff = float(re.search(r"max \|diff\| = (\S+)", capsys.readouterr().out).group(1))
    assert diff > 1e-3
