"""P10's workloads and models: which batch and which model ``flexgroup bench stream`` runs, and the ideal.

Workloads (``--workload``), each a list of sequences with loss masks and one advantage per sequence:

- ``group``: one prompt of ``prompt`` tokens and ``groups`` responses of ``response`` tokens, the loss
  on the responses (the issue's point: 4,096 + 16 x 1,024);
- ``tree``: the P7 agentic batch (:func:`flexgroup.bench.trees.agentic_batch`): one system prompt of
  ``system`` tokens shared by ``groups`` user prompts (task prompts of ``task`` tokens); per user
  prompt 8 trajectories of 3 turns (assistant message, tool reply) that branch at the first message
  (2 different ones), in the middle of the second (2 that share their first 16-48 tokens) and at the
  turn boundary before the third (2 each); loss on assistant tokens only.

Models (``--model``), random weights, float32, training mode:

- ``llama``: hidden 128, 2 layers, 4 query / 2 KV heads, MLP 512, vocab 128;
- ``hybrid``: a Qwen3.5-shaped ``qwen3_5_text`` of the same width (hidden 128, 4/2 heads of 32, MLP
  512, vocab 128) with Qwen3.5's 3:1 layer pattern in 4 layers: 3 Gated DeltaNet layers (2 key / 4
  value heads of 32, conv kernel 4) then 1 full-attention layer (partial interleaved M-RoPE).

The ideal is ``Layout.cost(ends)``'s exact decoder-FLOP ratio of each sequence alone over the packed
row: :func:`flexgroup.models.zoo.ideal_speedup` for the Llama, :func:`flexgroup.bench.hybrids.hybrid_flops`
(Linear layers, conv and chunked scan per token; attention pairs of the full-attention layers only) for
the hybrid. The LM head is left out of both.
"""

from __future__ import annotations

import torch

from .harness import build_model as build_llama
from .options import STREAM_MODELS, STREAM_WORKLOADS
from .hybrids import hybrid_flops
from .trees import agentic_batch
from ..models.zoo import build_model as build_zoo_model
from ..models.zoo import unavailable
from ..models.zoo import ideal_speedup as llama_ideal_speedup

LLAMA = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=128)
HYBRID = dict(hidden_size=128, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              vocab_size=128, num_hidden_layers=4, max_position_embeddings=65536,
              layer_types=["linear_attention"] * 3 + ["full_attention"])
MODELS, WORKLOADS = STREAM_MODELS, STREAM_WORKLOADS   # defined torch-free for the command line

# sizes per (workload, model); "quick" sizes (CI smoke test) are shared by both models
SIZES = {
    ("group", "llama"): dict(prompt=4096, groups=16, response=1024),
    ("group", "hybrid"): dict(prompt=4096, groups=16, response=1024),
    ("tree", "llama"): dict(system=2048, groups=3, task=(256, 512), assistant=(64, 128), tool=(128, 256)),
    ("tree", "hybrid"): dict(system=2048, groups=3, task=(256, 512), assistant=(64, 128), tool=(128, 256)),
    ("group", "quick"): dict(prompt=512, groups=4, response=128),
    ("tree", "quick"): dict(system=640, groups=1, task=(32, 64), assistant=(8, 24), tool=(16, 32)),
}
BUDGETS = {"full": (2048, 8192), "quick": (256, 1024)}


def sizes(workload: str, model: str, quick: bool) -> dict:
    """The size parameters of ``workload`` for ``model`` (``quick``: the CI smoke-test sizes)."""
    if workload not in WORKLOADS or model not in MODELS:
        raise ValueError(f"unknown workload {workload!r} or model {model!r}: choose a workload of {WORKLOADS} "
                         f"and a model of {MODELS}")
    return dict(SIZES[(workload, "quick" if quick else model)])


def group_batch(prompt: int, groups: int, response: int, seed: int = 0, vocab: int = LLAMA["vocab"]):
    """``(sequences, loss_masks, weights)``: G sequences ``[P; R_i]``, loss on the responses, weights [G]."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(1, vocab, (prompt,), generator=g)
    seqs = [torch.cat([p, torch.randint(1, vocab, (response,), generator=g)]) for _ in range(groups)]
    masks = [torch.arange(s.numel()) >= prompt for s in seqs]
    return seqs, masks, torch.linspace(-1.0, 1.0, groups)


def tree_batch(system: int, groups: int, task, assistant, tool, seed: int = 0, vocab: int = LLAMA["vocab"]):
    """``(sequences, loss_masks, weights)`` of the P7 agentic trees under a ``system``-token system prompt:
    N = 8 * groups sequences (LongTensors [n_i]), masks True on assistant tokens, weights [N]."""
    seqs, masks, _ = agentic_batch(seed, groups, (system, system), tuple(task), tuple(assistant), tuple(tool), vocab)
    return seqs, masks, torch.linspace(-1.0, 1.0, len(seqs))


def make_batch(workload: str, sz: dict, seed: int = 0):
    """``(sequences, loss_masks, weights)`` of ``workload`` at sizes ``sz`` (see :func:`sizes`)."""
    return (group_batch if workload == "group" else tree_batch)(**sz, seed=seed)


def build(model: str) -> torch.nn.Module:
    """The ``llama`` or ``hybrid`` model of this benchmark (seeded random weights, float32, training mode)."""
    if model == "llama":
        return build_llama(LLAMA)
    why = unavailable("qwen3_5_text")
    if why:
        raise NotImplementedError(f"flexgroup bench stream --model hybrid: {why}")
    return build_zoo_model("qwen3_5_text", size="demo", **HYBRID).train()


def ideal(model: str, config, batch) -> float:
    """Exact decoder-FLOP ratio of each sequence of ``batch`` (a ``GroupedBatch``) alone over its packed row."""
    if model == "llama":
        return llama_ideal_speedup(config, batch.layout, batch.sequence_ends)
    return batch.cost().ideal_speedup(*hybrid_flops(config))


def describe(workload: str, model: str, sz: dict) -> str:
    """One line naming the model and the batch's shape."""
    name = ("small Llama (hidden 128, 2 layers)" if model == "llama"
            else "Qwen3.5-shaped hybrid (hidden 128, 3 Gated DeltaNet + 1 full-attention layers)")
    if workload == "group":
        return f"{name}; prompt {sz['prompt']}, G = {sz['groups']} responses of {sz['response']}"
    return (f"{name}; tree: system prompt {sz['system']} shared by {sz['groups']} user prompts of {sz['task']} "
            f"tokens, 8 three-turn trajectories each (assistant {sz['assistant']}, tool {sz['tool']}; branches at "
            f"turn 1, mid turn 2, before turn 3)")
