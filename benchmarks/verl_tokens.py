"""Tokens through the model per verl actor pass, verl's stock engine versus flexgroup's (docs/verl.md).

``python benchmarks/verl_tokens.py`` (needs verl 0.9; no GPU; about a minute on one core). Each batch is
built in verl's actor layout (left-padded prompts, right-padded responses, ``response_mask``), converted
with verl's ``left_right_2_no_padding`` and run through flexgroup's engine's own
``forward_backward_batch`` (forward-only, as verl's old-log-prob pass; fixed micro-batch sizes or
dynamic batch sizing, ``use_dynamic_bsz``): the engine plans the whole mini-batch into forwards by prefix
trie under verl's token budget. ``engine.flexgroup_stats`` gives the stock columns (counted on verl's
own micro-batches, ``prepare_micro_batches``: real tokens with ``use_remove_padding=True``; samples x
longest sample without) and the grouped tokens flexgroup fed the model. Token counts do not depend on
the weights, so the model is a stub that counts the tokens it is fed (checked against the engine's
count) and returns zero logits over a 509-token vocabulary: token ids are folded into it (``id % 509``),
which can only add sharing where two different ids collide at the same trie position (rare: 1/509 per
pair of siblings). ``balance_batch`` rows split the batch over 2 ranks first -- verl's own balancing,
verl's ``use_prefix_grouper`` group balancing, or flexgroup's
(:func:`flexgroup.integrations.verl_plan.group_balanced_partitions`) -- and run each rank's share.
A trie bigger than the budget is cut (streaming refused, as with more than one data-parallel replica),
except in the rows marked "streamed" (one replica): there the engine streams it
(:mod:`flexgroup.integrations.verl_stream`), and since the stub cannot run a stream, :func:`stub_stream`
feeds it the stream's token count (each trie token once).

Batches (seeded): GRPO -- 16 prompts (a 64-token system prompt shared by all, then 150-700 tokens)
x 8 responses of 50-500 tokens; agent loop -- 8 prompts (300-900 tokens) x 8 trajectories of 3-5
assistant turns (30-150 tokens) with tool results (50-300 tokens, ``response_mask`` 0) between them,
either sampled independently (they share the prompt) or branched (trajectory pairs repeat their
first turn and tool result).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

warnings.filterwarnings("ignore")
VOCAB = 32000
FOLD = 509  # the stub model's vocabulary (token ids folded into it)


def _ids(g, lo, hi=None):
    n = lo if hi is None else int(torch.randint(lo, hi + 1, (1,), generator=g))
    return torch.randint(10, VOCAB, (n,), generator=g)


def grpo(g):
    system = _ids(g, 64)
    rows = []
    for _ in range(16):
        p = torch.cat([system, _ids(g, 150, 700)])
        rows += [(p, r, torch.ones_like(r)) for r in (_ids(g, 50, 500) for _ in range(8))]
    return rows


def agent(g, branched: bool):
    rows = []
    for _ in range(8):
        p = _ids(g, 300, 900)
        first = None
        for j in range(8):
            if branched and j % 2 == 1:
                turns = list(first)
            else:
                turns = [(_ids(g, 30, 150), 1), (_ids(g, 50, 300), 0)]
                first = list(turns)
            for _ in range(int(torch.randint(2, 5, (1,), generator=g))):
                turns += [(_ids(g, 30, 150), 1), (_ids(g, 50, 300), 0)]
            turns.append((_ids(g, 30, 150), 1))
            r = torch.cat([t for t, _ in turns])
            rows.append((p, r, torch.cat([torch.full((len(t),), m) for t, m in turns])))
    return rows


def verl_batch(rows, **meta):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    rows = [(p % FOLD, r % FOLD, m) for p, r, m in rows]
    n, lp, lr = len(rows), max(len(p) for p, _, _ in rows), max(len(r) for _, r, _ in rows)
    prompts, pm = torch.zeros(n, lp, dtype=torch.long), torch.zeros(n, lp, dtype=torch.long)
    responses, ram, rm = (torch.zeros(n, lr, dtype=torch.long) for _ in range(3))
    for i, (p, r, m) in enumerate(rows):
        prompts[i, lp - len(p):], pm[i, lp - len(p):] = p, 1
        responses[i, :len(r)], ram[i, :len(r)], rm[i, :len(r)] = r, 1, m
    am = torch.cat([pm, ram], 1)
    data = TensorDict({"input_ids": torch.cat([prompts, responses], 1), "attention_mask": am,
                       "position_ids": compute_position_id_with_mask(am), "prompts": prompts,
                       "responses": responses, "response_mask": rm}, batch_size=[n])
    tu.assign_non_tensor(data, **meta)
    return left_right_2_no_padding(data)


class CountingLM(torch.nn.Module):
    """Stands in for the model: counts the tokens fed to it, returns zero logits [1, L, FOLD]."""

    def __init__(self):
        super().__init__()
        self.fed = 0

    def forward(self, input_ids, **kwargs):
        self.fed += input_ids.numel()
        return SimpleNamespace(logits=torch.zeros(1, input_ids.shape[-1], FOLD))


def make_engine():
    """flexgroup's verl engine around :class:`CountingLM` (verl's FSDP build skipped: no weights are needed)."""
    from flexgroup.integrations.verl import FlexGroupFSDPEngine, TokenStats

    class CountingEngine(FlexGroupFSDPEngine):
        def _flexgroup_patch(self):  # the stub has no attention to patch
            pass

    engine = CountingEngine.__new__(CountingEngine)
    engine.module, engine.flexgroup_stats, engine._flexgroup_warned = CountingLM(), TokenStats(), set()
    engine._flexgroup_planning, engine._autocast_dtype = False, torch.float32
    engine.ulysses_sequence_parallel_size, engine.use_ulysses_sp, engine.ulysses_device_mesh = 1, False, None
    engine.engine_config, engine.scaler = SimpleNamespace(strategy="fsdp2"), None   # one replica: streams allowed
    return engine


def stub_stream(engine, source, samples, budget, temperature, loss_function, forward_only, sync_last):
    """Stands in for :func:`flexgroup.integrations.verl_stream.run_stream` on the stub model: a stream encodes
    each token of its trie once (its samples plus the label token appended to each), which the stub is fed as
    a count in forwards of at most ``budget`` tokens (tests/integrations/test_verl_stream.py checks the count through a
    real model); zero log-probs."""
    from flexgroup.integrations.verl_batch import LAST_LABEL
    from flexgroup.integrations.verl_plan import grouped_tokens

    ids = source["input_ids"]
    rows = ids.values().split(ids.offsets().diff().tolist())
    last = source[LAST_LABEL]
    tokens = grouped_tokens([torch.cat([rows[i], last[i:i + 1]]).tolist() for i in samples])
    engine.module.fed += tokens
    outs = {i: {"log_probs": torch.zeros(rows[i].numel())} for i in samples}
    return outs, 0.0, -(-tokens // budget), tokens


def count(rows, stream: bool = False, **meta) -> dict[str, int]:
    from verl.workers.engine.utils import prepare_micro_batches

    from flexgroup.integrations import verl_batch as batch_module

    engine = make_engine()
    batch_module.run_stream = stub_stream if stream else _RUN_STREAM
    data = verl_batch(rows, temperature=1.0, calculate_entropy=False, use_remove_padding=True, use_fused_kernels=False,
                      **meta)
    n_micro = len(prepare_micro_batches(verl_batch(rows, **meta))[0])
    engine.get_data_parallel_size = lambda: 1
    if not stream:  # streaming refused (as with > 1 data-parallel replica): tries over the budget are cut
        engine.get_data_parallel_size = lambda: 2
    engine.forward_backward_batch(data, None, forward_only=True)
    st = engine.flexgroup_stats
    assert engine.module.fed == st.grouped_tokens and st.fallback_micro_batches == 0
    assert stream or st.streamed_tries == 0
    return {"micro_batches": n_micro, "stock_rmpad": st.real_tokens, "stock_padded": st.padded_tokens,
            "flexgroup": st.grouped_tokens}


def balanced(rows, dp: int, how: str, group: int = 8) -> list[list]:
    """Each data-parallel rank's rows after ``trainer.balance_batch=True``: ``how="verl"``, verl's
    ``_balance_batch`` (workload-balanced partitions, sorted within each rank); ``"prefix_grouper"``,
    verl's uid-group-balanced partitions (``actor.use_prefix_grouper=True``); ``"flexgroup"``, flexgroup's
    ``balance_batch`` (whole uid groups, balanced by grouped workload)."""
    from verl.utils.seqlen_balancing import (calculate_workload, get_group_balanced_partitions,
                                             get_seqlen_balanced_partitions)

    from flexgroup.integrations.verl_plan import group_balanced_partitions

    uids = [i // group for i in range(len(rows))]
    if how == "flexgroup":
        parts = group_balanced_partitions([(torch.cat([p, r]) % FOLD).tolist() for p, r, _ in rows], uids, dp)
    elif how == "prefix_grouper":
        parts = get_group_balanced_partitions([len(p) + len(r) for p, r, _ in rows], uids, dp)
    else:
        work = calculate_workload(torch.tensor([len(p) + len(r) for p, r, _ in rows]))
        parts = get_seqlen_balanced_partitions(work, k_partitions=dp, equal_size=True)
        for k, part in enumerate(parts):
            part.sort(key=lambda x: (work[x], x))
            parts[k] = part[::2] + part[1::2][::-1]
    return [[rows[i] for i in part] for part in parts]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
    from _verl_harness import register_cpu_platform  # verl has no CPU platform of its own

    register_cpu_platform()
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    g = torch.Generator().manual_seed(0)
    batches = {"GRPO 16x8": grpo(g), "agent loop 8x8, independent": agent(g, False),
               "agent loop 8x8, branched": agent(g, True)}
    splits = {"micro 8 (whole groups)": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 8},
              "micro 16 (two groups)": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 16},
              "micro 4 (half groups)": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4},
              "dynamic bsz, 16384 tokens": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 16384},
              "dynamic bsz, 8192 tokens": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 8192},
              "dynamic bsz, 8192 tokens, streamed": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 8192,
                                                      "stream": True},
              "micro 4 (half groups), streamed": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4,
                                                   "stream": True}}
    print("| batch | micro-batching | micro-batches | stock, remove-padding | stock, padded | flexgroup "
          "| flexgroup / remove-padding |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for bname, rows in batches.items():
        for sname, meta in splits.items():
            c = count(rows, **meta)
            _row(bname, sname, c)
        for how, label in (("verl", "verl's"), ("prefix_grouper", "verl's + use_prefix_grouper"),
                           ("flexgroup", "flexgroup's")):
            parts = [count(part, use_dynamic_bsz=False, micro_batch_size_per_gpu=8) for part in balanced(rows, 2, how)]
            c = {k: sum(p[k] for p in parts) for k in parts[0]}
            _row(bname, f"balance_batch over 2 ranks ({label}), micro 8", c)
    torch.distributed.destroy_process_group()


def _row(bname: str, sname: str, c: dict) -> None:
    print(f"| {bname} | {sname} | {c['micro_batches']} | {c['stock_rmpad']:,} | {c['stock_padded']:,} | "
          f"{c['flexgroup']:,} | {c['flexgroup'] / c['stock_rmpad']:.3f} |")


from flexgroup.integrations.verl_stream import run_stream as _RUN_STREAM  # noqa: E402


if __name__ == "__main__":
    main()
