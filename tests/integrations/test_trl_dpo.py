"""TRL DPOTrainer adapter: one optimisation step with and without flexgroup, same seed, same data.

The stock trainer is the oracle: it runs every [prompt; chosen] and [prompt; rejected] row through the
policy and the reference model as a right-padded batch. With the adapter each pair (and pairs that
repeat a prompt) becomes one group, so prompts are encoded once per model. Compared: the loss, the
chosen/rejected rewards TRL logs, and every parameter gradient; float64 (tight) and float32.
"""

from __future__ import annotations

import sys

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from _trainers import LETTERS, Recording, count_tokens, save_tiny_llama, word_tokenizer  # noqa: E402

from flexgroup.integrations.trl_dpo import FlexGroupDPOTrainer, PairPlan, pair_plan, patch_dpo_trainer  # noqa: E402

if not hasattr(sys.modules[trl.DPOTrainer.__module__], "add_fused_lm_head"):  # pragma: no cover - e.g. TRL 0.20
    pytest.skip("this TRL's DPOTrainer runs concatenated_forward over full logits (no fused LM head): flexgroup's "
                "DPO adapter does not cover it", allow_module_level=True)

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_dpo"))


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    """Another random checkpoint as the reference model: log-ratios, rewards and the loss are then
    non-trivial (with reference == policy they are exactly 0 and log 2 at the first step)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_dpo_ref"), seed=1)


def _words(g, n):
    return " ".join(LETTERS[int(i)] for i in torch.randint(0, 26, (n,), generator=g))


def _dataset():
    g = torch.Generator().manual_seed(2)
    prompts = [_words(g, n) for n in (14, 9, 20)]
    prompts.append(prompts[0])                  # a repeated prompt: its two pairs share one copy
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i, p in enumerate(prompts):
        rows["prompt"].append(p + " ")
        rows["chosen"].append(_words(g, 2 + i) + " ")
        rows["rejected"].append(_words(g, 5 - i % 3) + " ")
    return datasets.Dataset.from_dict(rows)


class Baseline(Recording, trl.DPOTrainer):
    pass


class Grouped(Recording, FlexGroupDPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, flexgroup_backend="sdpa", **kwargs)


def _config(tmp_path, dtype, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                max_steps=1, learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
                use_cpu=True, seed=0, bf16=False, fp16=False, beta=0.1, max_grad_norm=1.0,
                model_init_kwargs={"dtype": dtype, "attn_implementation": "sdpa"})
    base.update(kw)
    return trl.DPOConfig(**base)


def _reference(ref_dir, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ref_dir, dtype=dtype, attn_implementation="sdpa")


def _run(cls, model_dir, ref_dir, tmp_path, dtype, **kw):
    trainer = cls(model=model_dir, ref_model=_reference(ref_dir, dtype), args=_config(tmp_path, dtype, **kw),
                  train_dataset=_dataset(), processing_class=word_tokenizer())
    counts = count_tokens(trainer)
    trainer.train()
    return trainer, counts[0]


def _compare(base, grp, loss_tol, grad_rel):
    assert torch.isfinite(base.recorded_loss) and abs(base.recorded_loss.item() - 0.6931471805599453) > 1e-3
    assert abs(base.recorded_metrics["rewards/chosen"]) > 1e-4 and abs(base.recorded_metrics["rewards/rejected"]) > 1e-4
    torch.testing.assert_close(grp.recorded_loss, base.recorded_loss, rtol=loss_tol, atol=loss_tol)
    for k in METRICS:
        assert grp.recorded_metrics[k] == pytest.approx(base.recorded_metrics[k], rel=loss_tol, abs=loss_tol), k
    assert base.recorded_grads.keys() == grp.recorded_grads.keys() and len(base.recorded_grads) > 0
    for name, gb in base.recorded_grads.items():
        scale = gb.abs().max().item()
        err = (grp.recorded_grads[name] - gb).abs().max().item()
        assert scale > 0, f"{name} received no gradient"
        assert err <= grad_rel * scale, f"{name}: max |grad diff| {err:.3g}, grad scale {scale:.3g}"


# TRL's fused LM head computes in float32 even for a float64 model: float64 agreement stops near 1e-7
@pytest.mark.parametrize("dtype,loss_tol,grad_rel", [(torch.float64, 1e-6, 1e-6), (torch.float32, 1e-5, 1e-4)],
                         ids=["float64", "float32"])
def test_one_dpo_step_matches_stock_trainer(model_dir, ref_dir, tmp_path, dtype, loss_tol, grad_rel):
    base, base_tokens = _run(Baseline, model_dir, ref_dir, tmp_path / "base", dtype)
    grp, grp_tokens = _run(Grouped, model_dir, ref_dir, tmp_path / "grp", dtype)
    _compare(base, grp, loss_tol, grad_rel)
    stats = grp.flexgroup_stats
    assert set(stats) == {"policy", "ref"}, dict(stats)
    for role in ("policy", "ref"):
        assert stats[role]["fallback_tokens"] == 0 and stats[role]["forwards"] == 1
        assert stats[role]["grouped_tokens"] < stats[role]["real_tokens"] <= stats[role]["baseline_tokens"]
    assert grp_tokens == sum(s["grouped_tokens"] for s in stats.values()) < base_tokens
    print(f"\nDPO step ({dtype}): tokens through the models: stock TRL {base_tokens}, flexgroup {grp_tokens} "
          f"({grp_tokens / base_tokens:.2f})\n{grp.flexgroup_report()}")


def test_wrong_row_is_caught(model_dir, ref_dir, tmp_path, monkeypatch):
    """Broken variant: hidden states scattered to the neighbouring row; the step comparison must fail."""
    base, _ = _run(Baseline, model_dir, ref_dir, tmp_path / "base", torch.float32)
    real = PairPlan.scatter
    monkeypatch.setattr(PairPlan, "scatter", lambda self, h: real(self, h).roll(1, 0))
    grp, _ = _run(Grouped, model_dir, ref_dir, tmp_path / "grp", torch.float32)
    with pytest.raises(AssertionError):
        _compare(base, grp, 1e-5, 1e-4)


def test_patch_existing_trainer_and_precomputed_reference(model_dir, ref_dir, tmp_path):
    """patch_dpo_trainer on a stock trainer; reference log-probs precomputed through the grouped path too."""
    base, _ = _run(Baseline, model_dir, ref_dir, tmp_path / "base", torch.float32)
    trainer = trl.DPOTrainer(model=model_dir, ref_model=_reference(ref_dir, torch.float32),
                             args=_config(tmp_path / "p", torch.float32),
                             train_dataset=_dataset(), processing_class=word_tokenizer())
    assert patch_dpo_trainer(trainer, backend="sdpa") is trainer and isinstance(trainer, trl.DPOTrainer)
    assert type(trainer).__name__ == "FlexGroupDPOTrainer"
    trainer.train()
    assert trainer.flexgroup_stats["policy"]["forwards"] == 1
    loss = trainer.state.log_history[0]["loss"]
    assert loss == pytest.approx(float(base.recorded_loss), abs=1e-5)

    pre = Grouped(model=model_dir, ref_model=_reference(ref_dir, torch.float32),
                  args=_config(tmp_path / "pre", torch.float32, precompute_ref_log_probs=True),
                  train_dataset=_dataset(), processing_class=word_tokenizer())
    assert pre.flexgroup_stats["ref"]["forwards"] == 1      # precomputed in __init__, through the grouped call
    pre.train()
    torch.testing.assert_close(pre.recorded_loss, base.recorded_loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_peft_policy_with_adapter_disabled_reference(model_dir, tmp_path, task_type):
    """LoRA policy; TRL's reference is the same model with the adapter disabled: both roles grouped.
    With task_type="CAUSAL_LM" PEFT's wrapper passes inputs_embeds=None, return_dict=None, ... explicitly."""
    peft = pytest.importorskip("peft")
    runs = {}
    for name, cls in (("base", Baseline), ("grp", Grouped)):
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                               init_lora_weights=False, task_type=task_type)   # random B: the adapter changes the outputs
        runs[name] = cls(model=model_dir, args=_config(tmp_path / name, torch.float32), train_dataset=_dataset(),
                         processing_class=word_tokenizer(), peft_config=lora)
        runs[name].train()
    _compare(runs["base"], runs["grp"], 1e-5, 1e-4)
    stats = runs["grp"].flexgroup_stats
    assert stats["policy"]["forwards"] == stats["ref"]["forwards"] == 1 and not stats["policy"]["fallback_tokens"]


def test_peft_prompt_tuning_takes_the_stock_path_with_one_warning(model_dir, tmp_path):
    """Prompt learning prepends virtual tokens, so the policy's calls cannot be grouped: said once, counted."""
    peft = pytest.importorskip("peft")
    cfg = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    trainer = Grouped(model=model_dir, args=_config(tmp_path, torch.float32, max_steps=2), train_dataset=_dataset(),
                      processing_class=word_tokenizer(), peft_config=cfg)
    with pytest.warns(UserWarning, match="stock DPO forward") as record:
        trainer.train()
    assert len([w for w in record if "flexgroup" in str(w.message)]) == 1
    stats = trainer.flexgroup_stats
    assert stats["policy"]["fallback_tokens"] > 0 and stats["policy"]["forwards"] == 0
    assert stats["ref"]["forwards"] == 2      # the reference (adapter disabled) is grouped


def test_pair_plan_shares_prefixes_and_refuses():
    ids = torch.tensor([[5, 6, 7, 8, 0], [9, 6, 3, 0, 0], [5, 6, 7, 4, 4], [9, 6, 2, 2, 2]])
    am = (ids != 0).long()
    plan = pair_plan(ids, am)
    assert plan.batch.num_tokens == (3 + 1 + 2) + (2 + 1 + 3)   # [5, 6, 7] and [9, 6] encoded once
    h = torch.arange(plan.batch.num_tokens, dtype=torch.float64)[None, :, None]
    out = plan.scatter(h)[..., 0]
    assert torch.equal(plan.batch.input_ids[out.long()] * am, ids * am)   # every real token lands on itself
    assert (out[am == 0] == 0).all()
    left = torch.tensor([[0, 5, 6, 7, 8]])
    assert "right padding" in pair_plan(left, (left != 0).long())
    assert "fewer than 2" in pair_plan(ids[:1, :2], torch.tensor([[1, 0]]))


def test_bf16_autocast_runs_trls_own_head_on_both_paths(model_dir, ref_dir, tmp_path, monkeypatch):
    """Under bf16 autocast the GRPO adapter once read another head than TRL's (trl_head.py); the DPO adapter cannot:
    it replaces only the decoder call, and TRL's fused head (built without ``cast_lm_head_to_fp32``, which DPOConfig
    does not have in TRL 1.16) runs on the scattered hidden states in both trainers, with the same dtypes under the
    same autocast. What differs is bf16 rounding inside the decoder (packed vs padded rows)."""
    import trl.trainer.utils as trl_utils

    if "cast_lm_head_to_fp32" in trl.DPOConfig.__dataclass_fields__:   # a TRL that adds it: TRL's head reads it
        pytest.skip(f"TRL {trl.__version__}'s DPOConfig has cast_lm_head_to_fp32: compare with it on and off")
    calls = []
    real = trl_utils._ChunkedLogProbFunction.apply

    def head(hidden, weight, *args):
        calls.append((hidden.dtype, weight.dtype, torch.is_autocast_enabled(hidden.device.type)))
        return real(hidden, weight, *args)

    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", head)
    base, _ = _run(Baseline, model_dir, ref_dir, tmp_path / "base", torch.float32, bf16=True)
    assert base.accelerator.mixed_precision == "bf16"
    stock_calls, calls[:] = list(calls), []
    grp, _ = _run(Grouped, model_dir, ref_dir, tmp_path / "grp", torch.float32, bf16=True)
    assert calls == stock_calls and len(calls) >= 2 and all(autocast for *_, autocast in calls)
    assert grp.flexgroup_stats["policy"]["forwards"] and grp.flexgroup_stats["ref"]["forwards"]
    torch.testing.assert_close(grp.recorded_loss, base.recorded_loss, rtol=1e-3, atol=1e-4)
