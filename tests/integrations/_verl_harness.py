"""Harness for tests/integrations/test_verl.py: verl's STOCK FSDP engine and flexgroup's engine on the same batches.

``python tests/integrations/_verl_harness.py OUTDIR WORLD`` (a fresh interpreter: the CPU platform must be
registered before verl's engine module is imported, and gloo ranks are processes). It saves a random
tiny Qwen2 to ``OUTDIR/model``, spawns ``WORLD`` gloo ranks on 127.0.0.1, and on every rank builds,
per case, both engines from that checkpoint (``strategy="fsdp2"``, ``attn_implementation="sdpa"``) and
runs verl's own ``forward_backward_batch`` with verl's own ``ppo_loss`` (or the forward-only pass that
verl's old-log-prob and reference passes use) on the same verl-layout batch. Rank ``r`` writes
``OUTDIR/rank{r}.pt``: per case and engine the micro-batch losses, every log-prob / entropy value
verl returned, every full (unsharded) parameter gradient, flexgroup's warnings and token counts.

Batches (each rank its own samples): ``grpo`` -- 3 prompts x 4 responses, two prompts sharing a
system prefix, one duplicate response; ``multiturn`` -- verl agent-loop rows, one flat row per
trajectory ``[prompt; a1 t1 a2 t2 a3]`` with ``response_mask`` 0 on the tool tokens ``t*``,
trajectories that repeat earlier turns and one identical trajectory.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import tempfile
import warnings
from functools import partial
from pathlib import Path

import torch

VOCAB = 61
LP, LR = 14, 16           # padded prompt / response widths


# ---------------------------------------------------------------------------------------- platform
def register_cpu_platform() -> None:
    """verl has no CPU platform: register a minimal one (device "cpu", gloo) and make it current."""
    from verl.plugin.platform import PlatformRegistry, set_platform
    from verl.plugin.platform.platform_base import PlatformBase

    class CpuDeviceModule:
        """``torch.cpu`` plus the memory queries verl makes of its device module (all zero here)."""

        def __getattr__(self, name):
            return getattr(torch.cpu, name)

        def max_memory_allocated(self, *a, **k): return 0
        def max_memory_reserved(self, *a, **k): return 0
        def memory_allocated(self, *a, **k): return 0
        def memory_reserved(self, *a, **k): return 0
        def mem_get_info(self, *a, **k): return (0, 0)
        def reset_peak_memory_stats(self, *a, **k): pass
        def empty_cache(self): pass
        def manual_seed(self, s): torch.manual_seed(s)
        def manual_seed_all(self, s): torch.manual_seed(s)
        def current_device(self): return "cpu"
        def set_device(self, d): pass
        def synchronize(self, d=None): pass
        def is_available(self): return True
        def device_count(self): return 1

    @PlatformRegistry.register(platform="flexgroup_test_cpu")
    class CpuPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = CpuDeviceModule()
        def is_available(self): return True
        def current_device(self): return "cpu"
        def device_count(self): return 1
        def set_device(self, i): pass
        def synchronize(self, i=None): pass
        def manual_seed(self, s): torch.manual_seed(s)
        def manual_seed_all(self, s): torch.manual_seed(s)
        def set_allocator_settings(self, s): pass
        def empty_cache(self): pass
        def get_device_capability(self, i=0): return (None, None)
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "FLEXGROUP_TEST_VISIBLE_CPUS"
        @contextlib.contextmanager
        def nvtx_range(self, msg): yield
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

    set_platform(CpuPlatform())

    # verl has no float64 precision name; the tests add one (both engines see the same dtype)
    from verl.utils.torch_dtypes import PrecisionType

    to_dtype = PrecisionType.to_dtype
    PrecisionType.to_dtype = staticmethod(lambda p: torch.float64 if p in ("fp64", torch.float64) else to_dtype(p))


# ---------------------------------------------------------------------------------------- batches
def _ids(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=g)


def grpo_rows(rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(prompt, response, response_mask) per sample: 3 prompts x 4 responses (prompts 0 and 1 share a
    system prefix; response 3 of prompt 0 repeats response 1)."""
    g = torch.Generator().manual_seed(100 + rank)
    system = _ids(g, 5)
    prompts = [torch.cat([system, _ids(g, 4 + rank)]), torch.cat([system, _ids(g, 6)]), _ids(g, 9 - rank)]
    rows = []
    for k, p in enumerate(prompts):
        rs = [_ids(g, int(torch.randint(2, LR + 1, (1,), generator=g))) for _ in range(4)]
        if k == 0:
            rs[3] = rs[1].clone()
        rows += [(p, r, torch.ones_like(r)) for r in rs]
    return rows


def multiturn_rows(rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """verl agent-loop rows: response ``a1 t1 a2 [t2 a3]``, mask 1 on assistant turns, 0 on tool turns.
    Per prompt: trajectories 0 and 1 repeat turns a1 t1 and branch at a2; 2 branches at a1; 3 repeats 0."""
    g = torch.Generator().manual_seed(200 + rank)
    rows = []
    for plen in (8 + rank, 6):
        p = _ids(g, plen)
        a1, t1 = _ids(g, 3), _ids(g, 2)

        def traj(first, tool):
            turns = [(first, 1), (tool, 0), (_ids(g, 2 + int(torch.randint(0, 3, (1,), generator=g))), 1)]
            if int(torch.randint(0, 2, (1,), generator=g)):
                turns += [(_ids(g, 2), 0), (_ids(g, 2), 1)]
            return torch.cat([t for t, _ in turns]), torch.cat([torch.full((len(t),), m) for t, m in turns])

        t0, t1_, t2 = traj(a1, t1), traj(a1, t1), traj(_ids(g, 2), _ids(g, 3))
        rows += [(p, r, m) for r, m in (t0, t1_, t2, (t0[0].clone(), t0[1].clone()))]
    return rows


def verl_batch(rows, *, use_remove_padding: bool, temperature=0.7, position_shift: int = 0, widths=None, **meta):
    """verl's actor batch for ``rows``, converted as verl's trainer does (``left_right_2_no_padding``);
    ``widths``: the padded (prompt, response) widths, default ``(LP, LR)``."""
    LP, LR = widths or (globals()["LP"], globals()["LR"])
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    n = len(rows)
    prompts, pmask = torch.zeros(n, LP, dtype=torch.long), torch.zeros(n, LP, dtype=torch.long)
    responses, amask_r = torch.zeros(n, LR, dtype=torch.long), torch.zeros(n, LR, dtype=torch.long)
    rmask = torch.zeros(n, LR, dtype=torch.long)
    for i, (p, r, m) in enumerate(rows):
        prompts[i, LP - len(p):], pmask[i, LP - len(p):] = p, 1
        responses[i, :len(r)], amask_r[i, :len(r)], rmask[i, :len(r)] = r, 1, m
    am = torch.cat([pmask, amask_r], 1)
    g = torch.Generator().manual_seed(7)
    fields = {
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": am,
        "position_ids": compute_position_id_with_mask(am) + position_shift, "prompts": prompts,
        "responses": responses, "response_mask": rmask,
        "old_log_probs": torch.randn(n, LR, generator=g) * 0.3 - 4.0,
        "ref_log_prob": torch.randn(n, LR, generator=g) * 0.3 - 4.0,
        "advantages": torch.randn(n, 1, generator=g).expand(n, LR).clone(),
    }
    if isinstance(temperature, torch.Tensor):
        fields["temperature"] = temperature
    data = TensorDict(fields, batch_size=[n])
    base = dict(use_remove_padding=use_remove_padding, use_dynamic_bsz=False, micro_batch_size_per_gpu=4,
                global_batch_size=n, calculate_entropy=True, use_fused_kernels=False, return_model_output=True)
    if not isinstance(temperature, torch.Tensor):
        base["temperature"] = temperature
    tu.assign_non_tensor(data, **{**base, **meta})
    return left_right_2_no_padding(data)


# ---------------------------------------------------------------------------------------- engines
def save_model(path: Path, arch: str = "Qwen2", seed: int = 0) -> None:
    """A tiny random ``{arch}ForCausalLM`` (Qwen2: the registry; Olmo2: the generic path)."""
    import transformers

    cfg = getattr(transformers, f"{arch}Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        architectures=[f"{arch}ForCausalLM"])
    torch.manual_seed(seed)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)


def make_engine(cls, model_dir: Path, dtype: str, use_remove_padding: bool, attn: str | None = "sdpa"):
    """``attn=None``: verl's default attention implementation (``flash_attention_2``)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    override = {} if attn is None else {"attn_implementation": attn}
    mc = HFModelConfig(path=str(model_dir), load_tokenizer=False, override_config=override,
                       use_remove_padding=use_remove_padding,
                       # non-reentrant checkpointing under a float64 TorchFunctionMode recomputes in float32
                       enable_gradient_checkpointing=dtype == "fp32")
    ec = FSDPEngineConfig(strategy="fsdp2", forward_only=False, use_torch_compile=False, model_dtype=dtype,
                          mixed_precision={"param_dtype": dtype, "reduce_dtype": dtype, "buffer_dtype": dtype})
    engine = cls(mc, ec, FSDPOptimizerConfig(lr=1e-3), CheckpointConfig())
    engine.initialize()
    return engine


def broken_engine_class():
    """flexgroup's engine with a classic shared-prefix bug, on purpose: each token is read from the
    packed row physically before it, so a later sibling's first token is predicted from the previous
    sibling's last token instead of from the shared prompt's last token."""
    from flexgroup.integrations.verl import FlexGroupFSDPEngine

    class PreviousRowEngine(FlexGroupFSDPEngine):
        def _flexgroup_outputs(self, logits, batch, mb):
            batch.paths = [torch.cat([p[1:] - 1, p[-1:]]).clamp(min=0) for p in batch.paths]  # row 0: no row before
            return super()._flexgroup_outputs(logits, batch, mb)

    return PreviousRowEngine


def count_embedded_tokens(engine) -> list[int]:
    """Independent token count: a one-element list summing the token ids entering the embedding."""
    seen = [0]
    engine.module.get_input_embeddings().register_forward_pre_hook(lambda m, args: seen.__setitem__(
        0, seen[0] + args[0].numel()))
    return seen


def run(engine, data, loss_fn):
    """One verl pass; returns what verl returned (values of every log-prob / entropy) and the grads."""
    if loss_fn is None:
        out = engine.infer_batch(data)
        grads = None
    else:
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(data, loss_fn, forward_only=False)
        grads = {n: p.grad.full_tensor().detach().clone() for n, p in engine.module.named_parameters()
                 if p.grad is not None}
    mo = out["model_output"]
    metrics = {k: [float(m) for m in (v.values if hasattr(v, "aggregate") else v)] for k, v in out["metrics"].items()}
    res = {"log_probs": mo["log_probs"].values().detach().clone(), "grads": grads,
           "entropy": mo["entropy"].values().detach().clone() if "entropy" in mo else None,
           "loss": torch.tensor(out["loss"], dtype=torch.float64), "offsets": mo["log_probs"].offsets().clone(),
           "metrics": metrics}
    return res


# ---------------------------------------------------------------------------------------- cases
def cases():
    """(name, dtype, use_remove_padding, rows, batch kwargs, train?) -- every case runs stock and flexgroup."""
    out = []
    for dtype in ("fp64", "fp32"):
        for rmpad in (True, False):
            for kind, rows in (("grpo", grpo_rows), ("multiturn", multiturn_rows)):
                kw = {"micro_batch_size_per_gpu": 6} if kind == "grpo" else {}  # 6: micro-batches split groups
                out.append((f"{kind}-train-{dtype}-{'rmpad' if rmpad else 'padded'}", dtype, rmpad, rows, kw, True))
    out += [
        ("grpo-old-log-prob-fp32", "fp32", True, grpo_rows, {}, False),
        ("multiturn-ref-log-prob-fp32", "fp32", True, multiturn_rows, {"calculate_entropy": False}, False),
        ("grpo-per-sample-temperature-fp32", "fp32", True, grpo_rows,
         {"temperature": torch.tensor([0.7, 1.3, 1.0] * 4)}, True),
        ("grpo-dynamic-bsz-fp32", "fp32", True, grpo_rows,
         {"use_dynamic_bsz": True, "max_token_len_per_gpu": 64}, True),
        ("multiturn-shifted-positions-fp32", "fp32", True, multiturn_rows, {"position_shift": 2}, True),
        # planning the whole mini-batch (issue 29): verl's splits that scatter groups, a trie over the budget,
        # a loss mode that normalizes per micro-batch (kept: one warning), balance_batch's reordering
        ("grpo-half-groups-fp64", "fp64", True, grpo_rows, {"micro_batch_size_per_gpu": 2}, True),
        ("grpo-dynamic-bsz-fp64", "fp64", True, grpo_rows, {"use_dynamic_bsz": True, "max_token_len_per_gpu": 64}, True),
        ("multiturn-dynamic-bsz-fp32", "fp32", True, multiturn_rows,
         {"use_dynamic_bsz": True, "max_token_len_per_gpu": 64}, True),
        ("grpo-trie-over-budget-fp32", "fp32", True, grpo_rows,
         {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30}, True),
        ("grpo-balanced-fp32", "fp32", True, balanced_rows, {"micro_batch_size_per_gpu": 2}, True),
        ("grpo-balanced-fp64", "fp64", False, balanced_rows, {"micro_batch_size_per_gpu": 2}, True),
        ("grpo-seq-norm-fp32", "fp32", True, grpo_rows, {"micro_batch_size_per_gpu": 2,
                                                          "loss_agg_mode": "seq-mean-token-sum-norm"}, True),
        ("grpo-uneven-ranks-fp32", "fp32", True, uneven_rows,
         {"use_dynamic_bsz": True, "max_token_len_per_gpu": 64}, True),
        ("grpo-geo-mean-fp32", "fp32", True, grpo_rows, {"micro_batch_size_per_gpu": 2, "loss_mode": "geo_mean"}, True),
        # a rank with fewer samples than another rank's planned forwards runs zero-loss padding forwards
        ("padding-forward-fp32", "fp32", True, padding_rows, {"use_dynamic_bsz": True, "max_token_len_per_gpu": 50}, True),
    ]
    return out


def padding_rows(rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Unrelated samples (nothing shared) under a budget of 50 tokens. Rank 0: 26, 26, 24, 24 tokens in trie
    order: verl's dynamic batching pairs them into 2 micro-batches of 50, flexgroup's next-fit plan in trie
    order makes 3 forwards ([26], [26, 24], [24]). Rank 1: two samples of 26 (verl: 2 micro-batches; at most 2
    forwards), so it runs one zero-loss padding forward to keep FSDP's collectives in step."""
    g = torch.Generator().manual_seed(400 + rank)
    rows = []
    for k, rlen in enumerate((12, 12, 10, 10) if rank == 0 else (12, 12)):
        p, r = _ids(g, LP), _ids(g, rlen)
        p[0] = 3 + k  # the trie (lexicographic) order is the order above
        rows.append((p, r, torch.ones_like(r)))
    return rows


def uneven_rows(rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Rank 0: 3 GRPO groups; rank 1: two -- fewer planned forwards, so it splits its own to match."""
    return grpo_rows(rank) if rank == 0 else grpo_rows(rank)[:8]


def balanced_rows(rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's share of ranks 0 and 1's GRPO rows after flexgroup's ``balance_batch`` partitioning
    (whole uid groups per rank, balanced by grouped workload), over two ranks."""
    from flexgroup.integrations.verl_plan import group_balanced_partitions

    rows = grpo_rows(0) + grpo_rows(1)
    parts = group_balanced_partitions([torch.cat([p, r]).tolist() for p, r, _ in rows], [i // 4 for i in range(24)], 2)
    return [rows[i] for i in parts[rank % 2]]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, outdir: str, cases_fn=None) -> None:
    """One gloo rank: ``cases_fn(rank, out)`` (default this harness's cases) between init and a final barrier."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*engine is not available.*")
    register_cpu_platform()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        (cases_fn or _cases)(rank, Path(outdir))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _cases(rank: int, out: Path) -> None:
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import KeepFloat64

    os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # the registry lookup as on a GPU worker
    before = EngineRegistry.get_engine_cls("language_model", "fsdp2")
    from verl.workers.config import HFModelConfig

    HFModelConfig(path=str(out / "model"), load_tokenizer=False, external_lib="flexgroup.integrations.verl")
    from flexgroup.integrations import verl as fg_verl

    result = {"registry": {"before": before.__name__,
                           "after_external_lib": EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__}}
    fg_verl.unregister()
    result["registry"]["after_unregister"] = EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__
    os.environ.pop("VERL_ENGINE_DEVICE")

    engines = {}
    for name, dtype, rmpad, rows_fn, kw, train in cases():
        kw = dict(kw)
        temperature = kw.pop("temperature", 0.7)
        shift = kw.pop("position_shift", 0)
        agg = kw.pop("loss_agg_mode", "token-mean")
        policy = {"loss_mode": kw.pop("loss_mode", "vanilla")}
        rows = rows_fn(rank)
        cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=4, ppo_mini_batch_size=len(rows),
                              ppo_micro_batch_size_per_gpu=4, use_remove_padding=rmpad, loss_agg_mode=agg,
                              policy_loss=PolicyLossConfig(**policy),
                              entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
        loss_fn = partial(ppo_loss, cfg) if train else None
        kinds = [("stock", FSDPEngineWithLMHead), ("flexgroup", fg_verl.FlexGroupFSDPEngine)]
        if name == "grpo-train-fp32-rmpad":
            kinds.append(("broken", broken_engine_class()))
        if name == "padding-forward-fp32":  # broken: the padding forward back-propagates its sample's real loss
            kinds.append(("broken-padding", fg_verl.FlexGroupFSDPEngine))
        result[name] = {}
        for kind, cls in kinds:
            key = ("flexgroup" if kind == "broken-padding" else kind, dtype, rmpad)
            if key not in engines:
                engines[key] = make_engine(cls, out / "model", dtype, rmpad)
                engines[key].embedded = count_embedded_tokens(engines[key])
            engine = engines[key]
            embedded_before = engine.embedded[0]
            data = verl_batch(rows, use_remove_padding=rmpad, temperature=temperature, position_shift=shift, **kw)
            mode = KeepFloat64() if dtype == "fp64" else contextlib.nullcontext()
            before_stats = dict(vars(engine.flexgroup_stats)) if hasattr(engine, "flexgroup_stats") else None
            with warnings.catch_warnings(record=True) as caught, mode, broken_padding(kind == "broken-padding", loss_fn):
                warnings.simplefilter("always")
                res = run(engine, data, loss_fn)
            res["embedded_tokens"] = engine.embedded[0] - embedded_before
            res["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("flexgroup")]
            if before_stats is not None:
                res["stats"] = {k: v - before_stats[k] for k, v in vars(engine.flexgroup_stats).items()}
            result[name][kind] = res
    result["stock_reasons"] = stock_reasons(rank)
    result["forced_plan"] = forced_plan_error(engines[("flexgroup", "fp32", True)], rank) \
        if torch.distributed.get_world_size() == 1 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = make_engine(fg_verl.FlexGroupFSDPEngine, out / "model", "fp32", True, attn=None)
    res = run(engine, verl_batch(multiturn_rows(rank), use_remove_padding=True, calculate_entropy=False), None)
    res["attn_implementation"] = engine.module.config._attn_implementation
    res["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("flexgroup")]
    result["verl-default-attention"] = {"flexgroup": res, "stock": result["multiturn-ref-log-prob-fp32"]["stock"]}
    torch.save(result, out / f"rank{rank}.pt")


@contextlib.contextmanager
def broken_padding(on: bool, loss_fn):
    """While ``on``: padding forwards run ``loss_fn`` (their sample's real loss) instead of a zero loss."""
    from flexgroup.integrations import verl_batch

    zero = verl_batch._zero_loss
    if on:
        verl_batch._zero_loss = loss_fn
    try:
        yield
    finally:
        verl_batch._zero_loss = zero


def forced_plan_error(engine, rank: int) -> str | None:
    """A broken variant: plan forwards although the policy loss normalizes per micro-batch (``geo_mean`` takes
    ``torch.mean`` over the micro-batch's sequences). The engine's guard (planned total vs verl's micro-batch
    total) must raise; returns its message (None: not caught)."""
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    from flexgroup.integrations import verl as fg_verl

    cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=4, ppo_mini_batch_size=12, ppo_micro_batch_size_per_gpu=4,
                          policy_loss=PolicyLossConfig(loss_mode="geo_mean"), entropy_coeff=0.01, use_kl_loss=True,
                          kl_loss_coef=0.1)
    data = verl_batch(grpo_rows(rank), use_remove_padding=True, micro_batch_size_per_gpu=2)
    refusal = fg_verl.plan_refusal
    fg_verl.plan_refusal = lambda loss_function, data: None
    try:
        engine.optimizer_zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.forward_backward_batch(data, partial(ppo_loss, cfg), forward_only=False)
    except RuntimeError as e:
        return str(e)
    finally:
        fg_verl.plan_refusal = refusal
    return None


def stock_reasons(rank: int) -> dict[str, str | None]:
    """What flexgroup's engine decides for micro-batches in modes it must not group (by mode)."""
    from types import SimpleNamespace

    from tensordict import NonTensorStack
    from verl.utils import tensordict_utils as tu

    from flexgroup.integrations.verl import fallback_reason, grouped_batch

    rows = grpo_rows(rank)
    n = len(rows)
    plain = SimpleNamespace(use_ulysses_sp=False, ulysses_sequence_parallel_size=1)
    out = {"plain": fallback_reason(plain, verl_batch(rows, use_remove_padding=True))}
    for mode, meta in (("fused", {"use_fused_kernels": True}), ("distillation", {"distillation_use_topk": True})):
        out[mode] = fallback_reason(plain, verl_batch(rows, use_remove_padding=True, **meta))
    mb = verl_batch(rows, use_remove_padding=True)
    mb["routed_experts"] = torch.zeros(n, 1)
    out["routing_replay"] = fallback_reason(plain, mb)
    mb = verl_batch(rows, use_remove_padding=True)
    mb["multi_modal_inputs"] = NonTensorStack(*[{"pixel_values": torch.zeros(1, 2)} for _ in range(n)])
    out["multimodal"] = fallback_reason(plain, mb)
    mb = verl_batch(rows, use_remove_padding=True)
    lens = mb["input_ids"].offsets().diff().tolist()
    mb["position_ids"] = torch.nested.as_nested_tensor([torch.arange(k).expand(4, k) for k in lens],
                                                       layout=torch.jagged)
    out["mrope"] = fallback_reason(plain, mb)
    mb = verl_batch(rows, use_remove_padding=True)
    mb["responses"][0, 0] += 1
    try:
        grouped_batch(mb)
        out["disagreeing_responses"] = None
    except ValueError as e:
        out["disagreeing_responses"] = str(e)
    return out


def main(outdir: str, world: int) -> None:
    out = Path(outdir)
    save_model(out / "model")
    port = _free_port()
    if world == 1:
        worker(0, 1, port, outdir)
    else:
        import torch.multiprocessing as mp

        mp.spawn(worker, args=(world, port, outdir), nprocs=world, join=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
