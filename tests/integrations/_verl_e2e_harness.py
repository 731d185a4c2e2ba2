"""Harness for tests/integrations/test_verl_e2e.py: two GRPO steps of verl's trainer loop, stock engine vs flexgroup's.

``python tests/integrations/_verl_e2e_harness.py OUTDIR`` (a fresh interpreter, one gloo rank on 127.0.0.1). verl
0.9's ``main_ppo`` cannot run on CPU: its rollout is an inference server (vLLM, SGLang or TensorRT-LLM
only; see docs/verl.md, "verl's trainer end to end"). So this drives the rest of a ``RayPPOTrainer`` step
in-process, without Ray: verl's config (``ppo_trainer.yaml`` composed by Hydra with the overrides of
``overrides()``), verl's ``ActorRolloutRefWorker`` (role ``actor``, and a second one with role ``ref``;
the engine workers of ``verl.workers.engine_workers``, which verl 0.9's trainer uses), and ``RayPPOTrainer``'s own methods
``_compute_old_log_prob``, ``_compute_ref_log_prob``, ``_update_actor`` and ``compute_advantage`` (GRPO)
called on a trainer whose worker groups are those in-process workers. The rollout is replayed: each step
draws 3 prompts x 4 responses (two prompts share a system prefix, one response repeats another) from a
seeded generator, the same for every engine; a rule scores each response.

Runs, one after another in this process, each from the same checkpoint: ``stock`` (verl's
``FSDPEngineWithLMHead``), ``flexgroup`` (``actor_rollout_ref.model.external_lib=flexgroup.integrations.verl``)
, ``broken`` (flexgroup's engine reading each token from the packed row before it, on purpose) and
``flexgroup_dynamic`` (flexgroup with dynamic batch sizes: the old-log-prob pass and the update packed by
other token budgets). Writes ``OUTDIR/result.pt``: per run and step the old / reference log-probs
(``[12, LR]`` float32, padded), the advantages, verl's actor metrics (``actor/pg_loss`` ...), every full
parameter before (``start``) and after (``weights``) the two steps, and per call of verl's ``ppo_loss`` the
update's and the old-log-prob pass's log-probs (``loss_inputs``).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _verl_harness import LP, LR, VOCAB, broken_engine_class, grpo_rows, register_cpu_platform, save_model  # noqa: E402

STEPS = 2
N = 4  # rollout.n


def overrides(model_dir: Path, dtype: str) -> list[str]:
    """The recipe: Hydra overrides of verl's ``ppo_trainer.yaml`` for a tiny GRPO run on CPU (both engines)."""
    a = "actor_rollout_ref"
    mp = "{param_dtype:%s,reduce_dtype:%s,buffer_dtype:%s}" % (dtype, dtype, dtype)
    out = [
        "algorithm.adv_estimator=grpo",
        f"{a}.model.path={model_dir}", "+" + f"{a}.model.load_tokenizer=False",
        f"+{a}.model.override_config.attn_implementation=sdpa", f"{a}.model.use_remove_padding=True",
        f"{a}.model.enable_gradient_checkpointing=False", f"{a}.rollout.n={N}", f"{a}.rollout.temperature=1.0",
        f"{a}.actor.ppo_mini_batch_size=3", f"{a}.actor.ppo_micro_batch_size_per_gpu=2",  # splits groups
        f"{a}.actor.ppo_epochs=2",  # the second epoch's ratio differs from 1: clipping, ppo_kl
        f"{a}.rollout.log_prob_micro_batch_size_per_gpu=2", f"{a}.ref.log_prob_micro_batch_size_per_gpu=2",
        f"{a}.actor.use_kl_loss=True", f"{a}.actor.kl_loss_coef=0.1", f"{a}.actor.entropy_coeff=0.01",
        f"{a}.actor.optim.lr=1e-3", f"{a}.actor.optim.clip_grad=1.0",
    ]
    for role in ("actor", "ref"):
        out += [f"{a}.{role}.strategy=fsdp2", f"{a}.{role}.fsdp_config.model_dtype={dtype}",
                f"{a}.{role}.fsdp_config.use_torch_compile=False", f"+{a}.{role}.fsdp_config.mixed_precision={mp}"]
    return out


# verl's usual settings for the ratio run: dynamic batch sizes, the old-log-prob pass packed into other
# micro-batches (by tokens) than the update's
DYNAMIC = ["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=80",
           "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=130",
           "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=130"]


def compose(model_dir: Path, dtype: str, external_lib: str | None, extra: list[str] = ()):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import verl.trainer.config as cfg_pkg

    GlobalHydra.instance().clear()
    extra = [f"actor_rollout_ref.model.external_lib={external_lib}"] * bool(external_lib) + list(extra)
    with initialize_config_dir(config_dir=str(Path(cfg_pkg.__file__).parent), version_base=None):
        return hydra_compose("ppo_trainer", overrides=overrides(model_dir, dtype) + extra)


def rollout(step: int):
    """verl's batch after generation and reward: ``DataProto`` with 12 samples (3 prompts x N), ``uid``s."""
    from verl import DataProto
    from verl.utils.model import compute_position_id_with_mask

    rows = grpo_rows(step)  # two different batches (the rank argument only varies lengths)
    n = len(rows)
    prompts, pmask = torch.zeros(n, LP, dtype=torch.long), torch.zeros(n, LP, dtype=torch.long)
    responses, rmask = torch.zeros(n, LR, dtype=torch.long), torch.zeros(n, LR, dtype=torch.long)
    for i, (p, r, _) in enumerate(rows):
        prompts[i, LP - len(p):], pmask[i, LP - len(p):] = p, 1
        responses[i, :len(r)], rmask[i, :len(r)] = r, 1
    am = torch.cat([pmask, rmask], 1)
    scores = torch.zeros(n, LR)
    for i, (_, r, _) in enumerate(rows):  # rule reward: fraction of even tokens, on the last response token
        scores[i, len(r) - 1] = (r % 2 == 0).float().mean()
    batch = DataProto.from_dict(
        tensors={"input_ids": torch.cat([prompts, responses], 1), "attention_mask": am,
                 "position_ids": compute_position_id_with_mask(am), "prompts": prompts, "responses": responses,
                 "response_mask": rmask, "token_level_scores": scores},
        non_tensors={"uid": np.array([f"s{step}p{i // N}" for i in range(n)], dtype=object)})
    batch.meta_info.update(global_token_num=am.sum(-1).tolist(), temperature=1.0)  # as verl's rollout output
    return batch


class Trainer:
    """The ``RayPPOTrainer`` methods of one training step, on in-process workers instead of Ray groups."""

    def __init__(self, config, actor, ref):
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer

        self.t = object.__new__(RayPPOTrainer)
        self.t.config, self.t.actor_rollout_wg, self.t.ref_policy_wg = config, actor, ref
        self.t.ref_in_actor, self.t.distillation_config = False, None

    def step(self, batch):
        from verl.trainer.ppo.ray_trainer import compute_advantage

        t = self.t
        old, _ = t._compute_old_log_prob(batch)
        old.batch.pop("entropys")
        batch = batch.union(old)
        batch = batch.union(t._compute_ref_log_prob(batch))
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        batch = compute_advantage(batch, adv_estimator="grpo", num_repeat=N, norm_adv_by_std_in_grpo=True,
                                  config=t.config.algorithm)
        metrics = t._update_actor(batch).meta_info["metrics"]
        kept = {key: batch.batch[key].clone() for key in ("old_log_probs", "ref_log_prob", "advantages")}
        return {**kept,
                "metrics": {k: [float(x) for x in (v if isinstance(v, list) else [v])] for k, v in metrics.items()}}


class LossInputs:
    """Wraps verl's ``ppo_loss`` (before the workers bind it) to record, per call, the log-probs of the update's
    forward and the old-log-prob pass's, padded ``[b, LR]`` float32, and the response mask ``[b, LR]``."""

    def __init__(self):
        import verl.workers.engine_workers as workers

        self.module, self.original, self.calls = workers, workers.ppo_loss, []
        workers.ppo_loss = self

    def __call__(self, config, model_output, data, dp_group=None):
        from verl.workers.utils.padding import no_padding_2_padding

        with torch.no_grad():
            new = no_padding_2_padding(model_output["log_probs"], data).detach().clone()
            old = data.select("old_log_probs", "response_mask").to_padded_tensor()
            self.calls.append({"log_prob": new, "old_log_prob": old["old_log_probs"].clone(),
                               "mask": old["response_mask"].clone()})
        return self.original(config, model_output, data, dp_group)

    def remove(self):
        self.module.ppo_loss = self.original


def run(model_dir: Path, dtype: str, kind: str) -> dict:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine_workers import ActorRolloutRefWorker

    # after a run, unregister() put verl's engine back; the flexgroup run imports the module afresh
    if kind.startswith("flexgroup") and "flexgroup.integrations.verl" in sys.modules:
        sys.modules["flexgroup.integrations.verl"].register()

    config = compose(model_dir, dtype, None if kind == "stock" else "flexgroup.integrations.verl",
                     DYNAMIC if kind == "flexgroup_dynamic" else [])
    torch.manual_seed(0)
    loss_inputs = LossInputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        workers = {}
        for role in ("actor", "ref"):
            workers[role] = ActorRolloutRefWorker(config.actor_rollout_ref, role=role)
            if kind == "broken":  # after external_lib registered flexgroup's engine: swap in the broken one
                table = EngineRegistry._engines["language_model"]["fsdp2"]
                table.update({key: broken_engine_class() for key in table})
            workers[role].init_model()
        engine = workers["actor"].actor.engine
        start = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                 for n, p in engine.module.named_parameters()}
        trainer = Trainer(config, workers["actor"], workers["ref"])
        steps = [trainer.step(rollout(s)) for s in range(STEPS)]
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for n, p in engine.module.named_parameters()}
    loss_inputs.remove()
    res = {"steps": steps, "weights": weights, "start": start, "engine": type(engine).__name__,
           "loss_inputs": loss_inputs.calls,
           "warnings": [str(w.message) for w in caught if str(w.message).startswith("flexgroup")],
           "stats": dict(vars(engine.flexgroup_stats)) if hasattr(engine, "flexgroup_stats") else None}
    if "flexgroup.integrations.verl" in sys.modules:
        sys.modules["flexgroup.integrations.verl"].unregister()
    return res


def main(outdir: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*engine is not available.*")
    out = Path(outdir)
    save_model(out / "model")
    register_cpu_platform()
    from verl.utils.device import get_torch_device

    type(get_torch_device()).get_device_name = lambda self, *a: "cpu"  # verl's MFU metric asks for it
    port = __import__("_verl_harness")._free_port()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # verl's workers would ask for "cpu:gloo,cpu:gloo" on this platform; a gloo group made first is kept
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    # verl's forward-only (reference) engine offloads with CPUOffloadPolicy(pin_memory=True): no pinning on CPU
    import verl.workers.engine.fsdp.transformer_impl as impl

    policy = impl.CPUOffloadPolicy
    impl.CPUOffloadPolicy = lambda pin_memory=True: policy(pin_memory=False)
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # the registry has no CPU engines: look up as a GPU worker does
    # stock first: flexgroup.integrations.verl is not imported yet, so only external_lib can register it
    result = {kind: run(out / "model", "fp32", kind) for kind in ("stock", "flexgroup", "broken", "flexgroup_dynamic")}
    result["external_lib"] = "actor_rollout_ref.model.external_lib=flexgroup.integrations.verl"
    torch.save(result, out / "result.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
