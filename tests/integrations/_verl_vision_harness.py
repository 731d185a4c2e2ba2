"""Harness for tests/integrations/test_verl_vision.py: verl's STOCK engine and flexgroup's on Qwen2.5-VL batches.

``python tests/integrations/_verl_vision_harness.py OUTDIR WORLD`` (a fresh interpreter, as
``_verl_harness.py``). It saves a tiny random Qwen2.5-VL and Qwen3-VL (``tests/patches/test_vl.py::make_vl``)
to ``OUTDIR/<model_type>``, spawns ``WORLD`` gloo ranks, and per case runs verl's ``forward_backward_batch`` (verl's
``ppo_loss``) or its forward-only pass on both engines. Rank ``r`` writes ``OUTDIR/rank{r}.pt``: per case
and engine every log-prob / entropy value, the losses, every parameter gradient (decoder and vision tower),
patch rows that entered the vision tower and token ids that entered the embedding (forward hooks: an
independent count), flexgroup's warnings and counts.

The batch is what verl's agent loop gives the actor for a Qwen-VL model: left-padded prompts with one image
each (placeholders expanded), right-padded text responses, ``position_ids`` ``[N, 4, L]`` = text positions +
the model's own ``get_rope_index`` of each whole row (as ``AgentLoopWorker._compute_position_ids``), and
``multi_modal_inputs`` (one mapping per sample, each with its own copy of its prompt's image). Prompts 0 and
1 have the same text and differently-pixelled images of one size: equal token ids, never shared.

verl's stock step runs with ``use_remove_padding=False``: with remove-padding verl replaces Qwen2.5-VL's
decoder attention by a flash-attention forward (``qwen2_vl_attn_forward``), which has no CPU kernel. The
stock engine's runs restore transformers' attention class-wide (:func:`stock_attention`); flexgroup's
``use_remove_padding=True`` runs keep verl's replacement installed, as on a GPU worker.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patches"))
from _verl_harness import _free_port, make_engine, run, worker  # noqa: E402

LP, LR = 20, 8
KINDS = ("qwen2_5_vl", "qwen3_vl")


def save_model(path: Path, kind: str) -> None:
    from test_vl import make_vl

    model = make_vl(kind)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)


def vl_rows(rank: int, kind: str = "qwen2_5_vl") -> list[tuple]:
    """(prompt ids, response ids, its vision) per sample: 3 prompts x 4 responses (one duplicate)."""
    from test_vl import Prompt

    g = torch.Generator().manual_seed(500 + rank)
    twin = torch.randint(3, 100, (3,), generator=g).tolist()
    prompts = []
    for k, (h, w) in enumerate(((4, 4), (4, 4), (4, 8 if rank == 0 else 4))):
        p = Prompt(kind, g)
        if k < 2:
            p.ids += twin                         # prompts 0 and 1: same text, same image size, other pixels
        else:
            p.text(2 + rank)
        p.image(h, w).text(2)
        prompts.append(p.build())
    rows = []
    for k, (ids, vision) in enumerate(prompts):
        rs = [torch.randint(3, 100, (int(torch.randint(2, LR + 1, (1,), generator=g)),), generator=g)
              for _ in range(4)]
        if k == 0:
            rs[3] = rs[1].clone()
        rows += [(ids, r, vision) for r in rs]
    return rows


def rope_ids(model, seq: torch.Tensor, vision: dict) -> torch.Tensor:
    """[3, n]: the stock model's own ``get_rope_index`` of the whole sequence (as verl's agent loop)."""
    from test_vl import IMG

    types = (seq == IMG).long()[None]
    pos, _ = model.model.get_rope_index(input_ids=seq[None], mm_token_type_ids=types,
                                        image_grid_thw=vision["image_grid_thw"],
                                        attention_mask=torch.ones_like(seq)[None])
    return pos[:, 0]


def verl_batch(rows, model, *, use_remove_padding: bool, foreign_positions: bool = False, widths=None, **meta):
    """verl's actor batch for ``rows`` (``left_right_2_no_padding``), with ``multi_modal_inputs``.
    ``foreign_positions``: every sample's M-RoPE rows + 1 (ids that are not the model's own); ``widths``: the
    padded (prompt, response) widths, default ``(LP, LR)``."""
    LP, LR = widths or (globals()["LP"], globals()["LR"])
    from tensordict import NonTensorData, NonTensorStack, TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    n = len(rows)
    prompts, pmask = torch.zeros(n, LP, dtype=torch.long), torch.zeros(n, LP, dtype=torch.long)
    responses, rmask = torch.zeros(n, LR, dtype=torch.long), torch.zeros(n, LR, dtype=torch.long)
    position_ids = torch.zeros(n, 4, LP + LR, dtype=torch.long)
    for i, (p, r, v) in enumerate(rows):
        prompts[i, LP - len(p):], pmask[i, LP - len(p):] = p, 1
        responses[i, :len(r)], rmask[i, :len(r)] = r, 1
        seq = torch.cat([p, r])
        cols = torch.arange(LP - len(p), LP + len(r))
        position_ids[i, 0, cols] = torch.arange(len(seq))
        position_ids[i, 1:, cols] = rope_ids(model, seq, v) + int(foreign_positions)
    am = torch.cat([pmask, rmask], 1)
    g = torch.Generator().manual_seed(7)
    data = TensorDict({
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": am, "position_ids": position_ids,
        "prompts": prompts, "responses": responses, "response_mask": rmask.clone(),
        "old_log_probs": torch.randn(n, LR, generator=g) * 0.3 - 4.0,
        "ref_log_prob": torch.randn(n, LR, generator=g) * 0.3 - 4.0,
        "advantages": torch.randn(n, 1, generator=g).expand(n, LR).clone(),
    }, batch_size=[n])
    base = dict(use_remove_padding=use_remove_padding, use_dynamic_bsz=False, micro_batch_size_per_gpu=4,
                global_batch_size=n, calculate_entropy=True, use_fused_kernels=False, return_model_output=True,
                temperature=0.7)
    tu.assign_non_tensor(data, **{**base, **meta})
    data = left_right_2_no_padding(data)
    data["multi_modal_inputs"] = NonTensorStack.from_list([NonTensorData(dict(v)) for _, _, v in rows])
    return data


def cases():
    """(name, model kind, dtype, flexgroup's use_remove_padding, batch kwargs, train?) -- stock runs padded."""
    out = []
    for dtype in ("fp64", "fp32"):
        for rmpad in (True, False):
            out.append((f"vl-train-{dtype}-{'rmpad' if rmpad else 'padded'}", dtype, rmpad, {}, True))
    out += [
        ("vl3-train-fp64-rmpad", "fp64", True, {"kind": "qwen3_vl"}, True),  # Qwen3-VL: deepstack features
        ("vl-old-log-prob-fp32", "fp32", True, {}, False),
        ("vl-ref-log-prob-fp64", "fp64", True, {"calculate_entropy": False}, False),
        # whole-mini-batch planning: verl's micro-batches of 2 split every group; dynamic batch sizing
        ("vl-half-groups-fp64", "fp64", True, {"micro_batch_size_per_gpu": 2}, True),
        ("vl-dynamic-bsz-fp32", "fp32", True, {"use_dynamic_bsz": True, "max_token_len_per_gpu": 80}, True),
        # fallback: M-RoPE ids that are not the model's own -> verl's stock step, one warning, bit-identical
        ("vl-foreign-positions-fp32", "fp32", False, {"foreign_positions": True}, True),
    ]
    return out


@contextlib.contextmanager
def stock_attention(on: bool):
    """While ``on``: transformers' own Qwen2.5-VL attention forward class-wide (verl's stock padded step)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLAttention

    now = Qwen2_5_VLAttention.forward
    if on:
        Qwen2_5_VLAttention.forward = TRANSFORMERS_ATTENTION
    try:
        yield
    finally:
        Qwen2_5_VLAttention.forward = now


@contextlib.contextmanager
def flat_positions(on: bool):
    """A broken variant, while ``on``: the grouped forward gets the virtual 1-D positions on all four rows
    (M-RoPE dropped: images placed as if they were text)."""
    from flexgroup.integrations import verl as fg_verl

    inputs = fg_verl.vl_model_inputs

    def broken(batch, device):
        from flexgroup.data.carrier import tag_position_ids

        out = inputs(batch, device)
        out["position_ids"] = tag_position_ids(out["position_ids"][:1].expand(4, -1, -1).clone(), batch.layout)
        return out

    if on:
        fg_verl.vl_model_inputs = broken
    try:
        yield
    finally:
        fg_verl.vl_model_inputs = inputs


def count_vision_patches(engine) -> list[int]:
    """Independent count: patch rows entering the vision tower (a forward pre-hook)."""
    seen = [0]
    model = getattr(engine.module, "_fsdp_wrapped_module", engine.module)
    model.model.visual.register_forward_pre_hook(lambda m, args: seen.__setitem__(0, seen[0] + args[0].shape[0]))
    return seen


TRANSFORMERS_ATTENTION = None


def _cases(rank: int, out: Path) -> None:
    global TRANSFORMERS_ATTENTION
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLAttention

    TRANSFORMERS_ATTENTION = Qwen2_5_VLAttention.forward  # before verl builds (and patches) any model
    from verl.workers.config import FSDPActorConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import KeepFloat64
    from test_vl import make_vl

    from flexgroup.integrations import verl as fg_verl

    # each kind's stock model: its get_rope_index gives verl's position ids (unpatched, never run)
    rope_models = {kind: make_vl(kind) for kind in KINDS}
    result: dict = {}
    engines = {}
    for name, dtype, rmpad, kw, train in cases():
        kw = dict(kw)
        foreign = kw.pop("foreign_positions", False)
        kind_of_model = kw.pop("kind", "qwen2_5_vl")
        rope_model = rope_models[kind_of_model]
        rows = vl_rows(rank, kind_of_model)
        cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=4, ppo_mini_batch_size=len(rows),
                              ppo_micro_batch_size_per_gpu=4, use_remove_padding=rmpad, loss_agg_mode="token-mean",
                              entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
        loss_fn = partial(ppo_loss, cfg) if train else None
        kinds = [("stock", FSDPEngineWithLMHead, False), ("flexgroup", fg_verl.FlexGroupFSDPEngine, rmpad)]
        if name == "vl-train-fp32-rmpad":
            kinds.append(("broken", fg_verl.FlexGroupFSDPEngine, rmpad))
        result[name] = {}
        for kind, cls, engine_rmpad in kinds:
            key = (cls.__name__, dtype, engine_rmpad, kind_of_model)
            if key not in engines:
                with stock_attention(kind == "stock"):
                    engines[key] = make_engine(cls, out / kind_of_model, dtype, engine_rmpad)
                engines[key].patches = count_vision_patches(engines[key])
            engine = engines[key]
            before = engine.patches[0]
            data = verl_batch(rows, rope_model, use_remove_padding=engine_rmpad, foreign_positions=foreign, **kw)
            mode = KeepFloat64() if dtype == "fp64" else contextlib.nullcontext()
            stats = dict(vars(engine.flexgroup_stats)) if hasattr(engine, "flexgroup_stats") else None
            with warnings.catch_warnings(record=True) as caught, mode, stock_attention(kind == "stock"), \
                    flat_positions(kind == "broken"):
                warnings.simplefilter("always")
                res = run(engine, data, loss_fn)
            res["tower_patches"] = engine.patches[0] - before
            res["n_params"] = sum(1 for _ in engine.module.parameters())
            res["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("flexgroup")]
            if stats is not None:
                res["stats"] = {k: v - stats[k] for k, v in vars(engine.flexgroup_stats).items()}
            result[name][kind] = res
    result["ulysses_reason"] = _ulysses_reason(rank, rope_models["qwen2_5_vl"])
    torch.save(result, out / f"rank{rank}.pt")


def _ulysses_reason(rank: int, model) -> str | None:
    """What the engine decides for a vision-language micro-batch under Ulysses sequence parallelism."""
    from types import SimpleNamespace

    from flexgroup.integrations.verl import fallback_reason

    engine = SimpleNamespace(module=model, use_ulysses_sp=True, ulysses_sequence_parallel_size=2)
    return fallback_reason(engine, verl_batch(vl_rows(rank), model, use_remove_padding=True))


def main(outdir: str, world: int) -> None:
    out = Path(outdir)
    for kind in KINDS:
        save_model(out / kind, kind)
    port = _free_port()
    if world == 1:
        worker(0, 1, port, outdir, _cases)
    else:
        import torch.multiprocessing as mp

        mp.spawn(worker, args=(world, port, outdir, _cases), nprocs=world, join=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
