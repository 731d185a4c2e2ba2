"""Tokens through the model per verl actor pass, verl's stock engine versus flexgroup's (docs/verl.md).

``python benchmarks/verl_tokens.py`` (needs verl 0.9; no model, no GPU: token counts do not depend on
the weights). Each batch is built in verl's actor layout (left-padded prompts, right-padded
responses, ``response_mask``), converted with verl's ``left_right_2_no_padding`` and split into
micro-batches by verl's own ``prepare_micro_batches`` -- fixed micro-batch sizes and dynamic batch
sizing (``use_dynamic_bsz``, which balances micro-batches by workload and so reorders samples). Per
micro-batch it counts what verl's stock ``forward_step`` feeds the model (real tokens with
``use_remove_padding=True``; samples x longest sample without) and the packed row flexgroup's engine
feeds it instead (:func:`flexgroup.integrations.verl.grouped_batch`, the function the engine calls).

Batches (seeded): GRPO -- 16 prompts (a 64-token system prompt shared by all, then 150-700 tokens)
x 8 responses of 50-500 tokens; agent loop -- 8 prompts (300-900 tokens) x 8 trajectories of 3-5
assistant turns (30-150 tokens) with tool results (50-300 tokens, ``response_mask`` 0) between them,
either sampled independently (they share the prompt) or branched (trajectory pairs repeat their
first turn and tool result).
"""

from __future__ import annotations

import warnings

import torch

warnings.filterwarnings("ignore")
VOCAB = 32000


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


def count(rows, **meta) -> dict[str, int]:
    from verl.workers.engine.utils import prepare_micro_batches

    from flexgroup.integrations.verl import grouped_batch

    mbs, _ = prepare_micro_batches(verl_batch(rows, **meta))
    real = padded = grouped = 0
    for mb in mbs:
        lens = mb["input_ids"].offsets().diff()
        real += int(lens.sum())
        padded += lens.numel() * int(lens.max())
        grouped += grouped_batch(mb).num_tokens
    return {"micro_batches": len(mbs), "stock_rmpad": real, "stock_padded": padded, "flexgroup": grouped}


def balanced(rows, dp: int, keep_groups: bool, group: int = 8) -> list[list]:
    """Each data-parallel rank's rows after verl's ``_balance_batch`` (``trainer.balance_batch=True``):
    workload-balanced partitions sorted within each rank, or, with ``keep_groups``
    (``actor.use_prefix_grouper=True``), verl's uid-group-balanced partitions in group order."""
    from verl.utils.seqlen_balancing import (calculate_workload, get_group_balanced_partitions,
                                             get_seqlen_balanced_partitions)

    seqlens = torch.tensor([len(p) + len(r) for p, r, _ in rows])
    if keep_groups:
        parts = get_group_balanced_partitions(seqlens.tolist(), [i // group for i in range(len(rows))], dp)
    else:
        work = calculate_workload(seqlens)
        parts = get_seqlen_balanced_partitions(work, k_partitions=dp, equal_size=True)
        for k, part in enumerate(parts):
            part.sort(key=lambda x: (work[x], x))
            parts[k] = part[::2] + part[1::2][::-1]
    return [[rows[i] for i in part] for part in parts]


def main() -> None:
    g = torch.Generator().manual_seed(0)
    batches = {"GRPO 16x8": grpo(g), "agent loop 8x8, independent": agent(g, False),
               "agent loop 8x8, branched": agent(g, True)}
    splits = {"micro 8 (whole groups)": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 8},
              "micro 16 (two groups)": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 16},
              "micro 4 (half groups)": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4},
              "dynamic bsz, 16384 tokens": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 16384},
              "dynamic bsz, 8192 tokens": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 8192}}
    print("| batch | micro-batching | micro-batches | stock, remove-padding | stock, padded | flexgroup "
          "| flexgroup / remove-padding |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for bname, rows in batches.items():
        for sname, meta in splits.items():
            c = count(rows, **meta)
            _row(bname, sname, c)
        for keep in (False, True):
            parts = [count(part, use_dynamic_bsz=False, micro_batch_size_per_gpu=8) for part in balanced(rows, 2, keep)]
            c = {k: sum(p[k] for p in parts) for k in parts[0]}
            _row(bname, "balance_batch over 2 ranks" + (" + use_prefix_grouper" if keep else "") + ", micro 8", c)


def _row(bname: str, sname: str, c: dict) -> None:
    print(f"| {bname} | {sname} | {c['micro_batches']} | {c['stock_rmpad']:,} | {c['stock_padded']:,} | "
          f"{c['flexgroup']:,} | {c['flexgroup'] / c['stock_rmpad']:.3f} |")


if __name__ == "__main__":
    main()
