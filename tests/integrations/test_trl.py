"""TRL GRPOTrainer adapter: one training step with and without flexgroup, same seed, same generations.

Generations are fixed by replacing the policy's ``generate`` in both trainers with a deterministic
function of (prompt tokens, occurrence of that prompt in the batch): both runs score exactly the
same completions without sampling (TRL itself cuts them at the first EOS and builds the masks).
Old-policy log-probs are computed (``num_iterations=2``) and the reference model is used
(``beta > 0``), so all three roles go through the grouped forward. With ``steps_per_generation=1``
the step's micro-batch is the whole generation batch: the stock row shuffle and the adapter's group
shuffle only order the same rows differently, and GRPO's loss does not depend on row order.
"""

from __future__ import annotations

import collections
import re
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from _trainers import LETTERS, Recording, count_tokens, save_tiny_llama, word_tokenizer  # noqa: E402

from flexgroup.integrations.trl import FlexGroupGRPOTrainer, group_units, shuffle_groups  # noqa: E402

G = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _dataset(n: int):
    g = torch.Generator().manual_seed(1)
    prompts = []
    for i in range(n):
        L = 12 + 3 * i  # long prompts, short completions: the case shared prefixes are for
        prompts.append(" ".join(LETTERS[int(t)] for t in torch.randint(0, 26, (L,), generator=g)))
    return datasets.Dataset.from_dict({"prompt": prompts})


def _reward(completions, **kwargs):
    return [float(c.count("a") + c.count("e")) - 0.05 * len(c) for c in completions]


def _fix_generations(trainer) -> None:
    """Replace the policy's ``generate`` with a deterministic one (TRL calls ``model.generate`` and then
    cuts completions at the first EOS, in every TRL version); no sampling, same completions in every run.

    Completion of a prompt: a function of its real tokens and of its occurrence in the batch.
    """
    model = trainer.model
    width = trainer.args.max_completion_length
    eos, pad = trainer.processing_class.eos_token_id, trainer.processing_class.pad_token_id

    def generate(input_ids, attention_mask=None, **kwargs):
        seen = collections.Counter()
        rows = []
        for ids, m in zip(input_ids, attention_mask if attention_mask is not None else torch.ones_like(input_ids)):
            key = tuple(ids[m.bool()].tolist())
            j = seen[key]
            seen[key] += 1
            gen = torch.Generator().manual_seed(sum(key) * 7919 + j)
            n = 2 + (sum(key) + 5 * j) % (width - 1)          # 2..width tokens: right padding is exercised
            c = torch.randint(3, 29, (n,), generator=gen)
            if n < width:
                c[-1] = eos                                    # ends with EOS; a full-width one is truncated
            rows.append(torch.cat([c, torch.full((width - n,), pad)]))
        return torch.cat([input_ids, torch.stack(rows).to(input_ids)], 1)

    model.generate = generate


class Baseline(Recording, trl.GRPOTrainer):
    pass


class Grouped(Recording, FlexGroupGRPOTrainer):
    def __init__(self, *args, **kwargs):
        # exact sdpa everywhere (what "auto" also picks on CPU)
        super().__init__(*args, flexgroup_backend="sdpa", **kwargs)


class GroupedFused(Recording, FlexGroupGRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, flexgroup_backend="sdpa", flexgroup_fused=True, **kwargs)


def _config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=2 * G, num_generations=G,
                max_completion_length=8, steps_per_generation=1, gradient_accumulation_steps=1,
                num_iterations=2, beta=0.1, max_steps=1, learning_rate=1e-3, logging_steps=1,
                report_to="none", save_strategy="no", use_cpu=True, seed=0, bf16=False, fp16=False,
                max_grad_norm=1.0, disable_dropout=True, temperature=0.7,
                model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"})
    base.update(kw)
    return trl.GRPOConfig(**base)


def _run(cls, model_dir, tmp_path, ds):
    trainer = cls(model=model_dir, reward_funcs=_reward, args=_config(tmp_path), train_dataset=ds,
                  processing_class=word_tokenizer())
    _fix_generations(trainer)
    counts = count_tokens(trainer)
    trainer.train()
    return trainer, counts[0]


@pytest.mark.parametrize("grouped", [Grouped, GroupedFused], ids=["logits", "fused-readout"])
def test_one_step_matches_stock_trainer(grouped, model_dir, tmp_path):
    ds = _dataset(4)
    base, base_tokens = _run(Baseline, model_dir, tmp_path / "base", ds)
    grp, grp_tokens = _run(grouped, model_dir, tmp_path / "grp", ds)
    assert grp.flexgroup_fused == (grouped is GroupedFused)

    # the same step: loss and every parameter gradient (float32)
    assert torch.isfinite(base.recorded_loss)
    torch.testing.assert_close(grp.recorded_loss, base.recorded_loss, rtol=1e-5, atol=1e-6)
    assert base.recorded_grads.keys() == grp.recorded_grads.keys() and len(base.recorded_grads) > 0
    nonzero = 0
    for name, gb in base.recorded_grads.items():
        ga = grp.recorded_grads[name]
        scale = gb.abs().max().item()
        err = (ga - gb).abs().max().item()
        assert err <= 1e-4 * scale + 1e-8, f"{name}: max |grad diff| {err:.3g}, grad scale {scale:.3g}"
        nonzero += scale > 0
    assert nonzero == len(base.recorded_grads), "every parameter must receive a gradient in this setup"

    # all three roles went through the grouped forward, and processed fewer tokens
    stats = grp.flexgroup_stats
    assert {"policy", "old", "ref"} <= set(stats), dict(stats)
    for role in ("policy", "old", "ref"):
        assert stats[role]["grouped_tokens"] < stats[role]["real_tokens"] <= stats[role]["baseline_tokens"]
        assert stats[role]["fallback_tokens"] == 0
    assert grp_tokens == sum(s["grouped_tokens"] for s in stats.values())
    assert grp_tokens < base_tokens
    print(f"\ntokens through the models in one step: stock TRL {base_tokens}, flexgroup {grp_tokens} "
          f"({grp_tokens / base_tokens:.2f})\n{grp.flexgroup_report()}")


def test_micro_batches_hold_whole_groups(model_dir, tmp_path):
    # 4 prompts x G completions, split into 2 micro-batches of 2 groups each
    trainer = Grouped(model=model_dir, reward_funcs=_reward, train_dataset=_dataset(4),
                      args=_config(tmp_path, steps_per_generation=2, num_iterations=1, beta=0.0),
                      processing_class=word_tokenizer())
    _fix_generations(trainer)
    trainer.model.train()  # _prepare_inputs buffers micro-batches in training mode only
    batch = next(iter(trainer.get_train_dataloader()))
    torch.manual_seed(3)
    first = trainer._prepare_inputs(batch)
    seen = []
    for mb in trainer._buffered_inputs:
        units = group_units(mb["prompt_ids"], mb["prompt_mask"])
        assert [len(u) for u in units] == [G, G], "a micro-batch must hold whole groups"
        seen += [tuple(mb["prompt_ids"][u[0]].tolist()) for u in units]
    assert len(set(seen)) == 4
    assert first is trainer._buffered_inputs[0]


def test_shuffle_groups_keeps_rows_and_groups():
    p = torch.tensor([[5, 6], [5, 6], [0, 7], [0, 7], [0, 7], [5, 6], [5, 6], [8, 9]])
    m = (p != 0).long()
    units = group_units(p, m, max_size=3)
    assert units == [[0, 1], [2, 3, 4], [5, 6], [7]]
    assert group_units(p, m, max_size=1) == [[i] for i in range(8)]
    d = {"prompt_ids": p, "idx": torch.arange(8), "names": list("abcdefgh"), "n": torch.tensor(8), "x": None}
    torch.manual_seed(0)
    out = shuffle_groups(d, units)
    assert out["n"] is d["n"] and out["x"] is None
    assert sorted(out["idx"].tolist()) == list(range(8))
    assert out["names"] == [d["names"][i] for i in out["idx"].tolist()]
    got = [tuple(u) for u in group_units(out["prompt_ids"], None, max_size=3)]
    # each group appears once, contiguous, rows in their original order
    pos = out["idx"].tolist()
    assert sorted(pos[i] for u in got for i in u) == list(range(8))
    for u in units:
        where = [pos.index(i) for i in u]
        assert where == list(range(where[0], where[0] + len(u)))
    with pytest.raises(ValueError, match="rows"):
        shuffle_groups({"a": torch.zeros(3)}, units)


def test_patch_trainer_logps_and_entropies_equal_stock(model_dir, tmp_path):
    """patch_trainer on a stock trainer: per-token log-probs and entropies equal TRL's own, per role."""
    from flexgroup.integrations.trl import patch_trainer

    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=_reward, train_dataset=_dataset(2),
                              args=_config(tmp_path), processing_class=word_tokenizer())
    g = torch.Generator().manual_seed(5)
    p1, p2 = torch.randint(3, 29, (7,), generator=g), torch.randint(3, 29, (4,), generator=g)
    prompts = [p1, p1, p1, p2, p2, p1]                 # the last row repeats p1 outside its group
    comps = [torch.randint(3, 29, (n,), generator=g) for n in (3, 6, 1, 5, 2, 4)]
    Lp, Lc = 7, 6
    ids = torch.zeros(6, Lp + Lc, dtype=torch.long)
    am = torch.zeros(6, Lp + Lc, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        ids[i, Lp - len(p):Lp], am[i, Lp - len(p):Lp] = p, 1          # left-padded prompt
        ids[i, Lp:Lp + len(c)], am[i, Lp:Lp + len(c)] = c, 1          # right-padded completion
    cmask = am[:, Lp:].bool()

    def run(model, entropy):  # TRL asks entropies of the policy only
        with torch.no_grad():
            out = trainer._get_per_token_logps_and_entropies(model, ids, am, Lc, batch_size=4, compute_entropy=entropy)
        return out[0], out[1]

    stock = {"policy": run(trainer.model, True), "ref": run(trainer.ref_model, False)}
    assert patch_trainer(trainer, backend="sdpa") is trainer and isinstance(trainer, trl.GRPOTrainer)
    assert type(trainer).__name__ == "FlexGroupGRPOTrainer"
    for role, model in (("policy", trainer.model), ("ref", trainer.ref_model)):
        lp, ent = run(model, role == "policy")
        ref_lp, ref_ent = stock[role]
        assert lp.shape == ref_lp.shape == (6, Lc)
        torch.testing.assert_close(lp[cmask], ref_lp[cmask], atol=1e-5, rtol=0)
        assert (lp[~cmask] == 0).all()
        if role == "policy":
            torch.testing.assert_close(ent[cmask], ref_ent[cmask], atol=1e-5, rtol=0)
            assert (ent[~cmask] == 0).all()
        else:
            assert ent is None
    s = trainer.flexgroup_stats
    # batch_size=4: chunks of rows [0..3] (p1 x3, p2) and [4, 5] (p2, p1): 4 packed rows in all
    assert s["old"]["forwards"] + s["ref"]["forwards"] == 4
    real = int(am.sum())
    assert s["ref"]["grouped_tokens"] == real - 2 * len(p1)   # rows 1, 2 reuse row 0's prompt


@pytest.mark.parametrize("cast, fused, budget, warned", [
    (True, False, None, None), (True, False, 128, "stock TRL forward \\(cast_lm_head_to_fp32 under mixed precision"),
    (False, True, None, "flexgroup_fused under mixed precision reads the logits")], ids=["fp32-head", "fp32-head-budget",
                                                                                      "fused-autocast"])
def test_the_lm_head_under_mixed_precision_is_read_as_trl_reads_it(model_dir, tmp_path, cast, fused, budget, warned):
    """bf16 autocast: TRL's fused head runs in float32 outside autocast with ``cast_lm_head_to_fp32=True``, else
    under autocast; the model's own logits are autocast's, the fused readout's float32. Before, the grouped path
    read the other one: 9.6e-4 off in a log-prob, silently, in both the fp32-head and the fused-autocast cases.
    Now each reads what TRL computes (equal to its log-probs); with a token budget (a readout of the model's
    logits) the float32 head sends the call to TRL's method; a changed readout warns once, naming why."""
    from flexgroup.integrations.trl import patch_trainer

    if "cast_lm_head_to_fp32" not in trl.GRPOConfig.__dataclass_fields__:
        pytest.skip(f"TRL {trl.__version__} has no cast_lm_head_to_fp32")
    g = torch.Generator().manual_seed(5)
    p = torch.randint(3, 29, (7,), generator=g)
    ids = torch.cat([p.repeat(3, 1), torch.randint(3, 29, (3, 5), generator=g)], 1)
    am = torch.ones_like(ids)
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=_reward, train_dataset=_dataset(2),
                              args=_config(tmp_path, bf16=True, cast_lm_head_to_fp32=cast),
                              processing_class=word_tokenizer())
    assert trainer.accelerator.mixed_precision == "bf16"

    def logps():
        with torch.no_grad():
            return trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, am, 5)[0]

    stock = logps()
    patch_trainer(trainer, backend="sdpa", budget=budget, fused=fused)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = logps()
    said = [str(w.message) for w in seen if "flexgroup" in str(w.message)]
    assert (said == []) if warned is None else re.search(warned, said[0]), said
    torch.testing.assert_close(got, stock, atol=1e-6, rtol=0)
    if budget is None:
        assert trainer.flexgroup_stats["ref"]["grouped_tokens"] < ids.numel()


def test_a_temperature_changed_between_steps_is_read_as_trl_reads_it(model_dir, tmp_path):
    """A callback sets ``trainer.temperature`` after the first of two steps. TRL divides by the temperature its
    fused LM head was built with (``args.temperature``, in the constructor; earlier releases read
    ``self.temperature`` per call): the grouped path reads the same. Before, it read ``trainer.temperature`` per
    call, so the second step's loss and gradients were off (0.38 in a log-prob at 0.3 vs 0.7), silently."""
    from transformers import TrainerCallback

    class Retemper(TrainerCallback):
        trainer = None

        def on_step_end(self, args, state, control, **kwargs):
            self.trainer.temperature = 0.3

    def run(cls, out):
        cb = Retemper()
        trainer = cls(model=model_dir, reward_funcs=_reward, args=_config(out, max_steps=2), callbacks=[cb],
                      train_dataset=_dataset(4), processing_class=word_tokenizer())
        cb.trainer = trainer
        _fix_generations(trainer)
        trainer.train()
        assert trainer.state.global_step == 2 and trainer.temperature == 0.3
        return trainer

    base, grp = run(Baseline, tmp_path / "base"), run(Grouped, tmp_path / "grp")
    torch.testing.assert_close(grp.recorded_loss, base.recorded_loss, rtol=1e-5, atol=1e-6)
    for name, gb in base.recorded_grads.items():
        err = (grp.recorded_grads[name] - gb).abs().max().item()
        assert err <= 1e-4 * gb.abs().max().item() + 1e-8, f"{name}: max |grad diff| {err:.3g}"
    assert grp.flexgroup_stats["policy"]["fallback_tokens"] == 0


def test_a_model_without_trls_fused_head_is_refused_naming_it(model_dir, tmp_path):
    """TRL releases with the fused head divide by the temperature it was built with: a model whose forward is
    no longer that head (replaced after construction) has no temperature to read, and is refused."""
    import types

    from flexgroup.integrations import trl_head
    from flexgroup.integrations.trl import patch_trainer

    if not hasattr(trl.trainer.grpo_trainer, "add_fused_lm_head"):
        pytest.skip(f"TRL {trl.__version__} reads trainer.temperature per call")
    trainer = patch_trainer(trl.GRPOTrainer(model=model_dir, reward_funcs=_reward, train_dataset=_dataset(2),
                                            args=_config(tmp_path), processing_class=word_tokenizer()), backend="sdpa")
    ref = trainer.ref_model
    assert trl_head.temperature(trainer, ref) == trainer.args.temperature == 0.7
    ref.forward = types.MethodType(type(ref).forward, ref)
    with pytest.raises(RuntimeError, match="LlamaForCausalLM.forward is not that head"):
        trl_head.temperature(trainer, ref)
