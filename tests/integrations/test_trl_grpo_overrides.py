"""The GRPO adapter inside a user's trainer: overrides that call super(), and the global RNG.

- A trainer class (or a mixin) that wraps ``_get_per_token_logps_and_entropies(self, *args, **kwargs)``
  -- a common logging wrapper -- keeps running under ``patch_trainer``, and its ``super()`` call takes
  the grouped path: the oracle is the same trainer's stock method before patching.
- The group shuffle draws from the global RNG exactly as TRL's row shuffle does, so with the same
  seed the next generation samples the same completions as the stock trainer.
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from _trainers import LETTERS, save_tiny_llama, word_tokenizer  # noqa: E402

from flexgroup.integrations.trl import (FlexGroupGRPOTrainer, FlexGroupMixin, group_units, patch_trainer,  # noqa: E402
                                        shuffle_groups)

G = 3
# TRL releases with the row shuffle the adapter mirrors (trl.trainer.utils.shuffle_sequence_dict; not 0.20)
TRL_ROW_SHUFFLE = hasattr(pytest.importorskip("trl.trainer.utils"), "shuffle_sequence_dict")
needs_row_shuffle = pytest.mark.skipif(not TRL_ROW_SHUFFLE, reason="this TRL has no shuffle_sequence_dict "
                                       "(its generation loop predates the row shuffle the adapter mirrors)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_overrides"), seed=1)


def _reward(completions, **kwargs):
    return [float(c.count("a")) - 0.05 * len(c) for c in completions]


def _dataset(n):
    g = torch.Generator().manual_seed(1)
    return datasets.Dataset.from_dict(
        {"prompt": [" ".join(LETTERS[int(t)] for t in torch.randint(0, 26, (6 + 2 * i,), generator=g)) for i in range(n)]})


def _config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=2 * G, num_generations=G,
                max_completion_length=6, steps_per_generation=2, num_iterations=1, beta=0.0, report_to="none",
                use_cpu=True, bf16=False, fp16=False, seed=0, disable_dropout=True,
                model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"})
    base.update(kw)
    return trl.GRPOConfig(**base)


class LogsCalls:
    """A user's logging mixin: counts calls and delegates with *args / **kwargs."""

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        self.logged_calls = getattr(self, "logged_calls", 0) + 1
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)


class MixedIn(LogsCalls, trl.GRPOTrainer):
    pass


class Subclassed(trl.GRPOTrainer):
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        self.logged_calls = getattr(self, "logged_calls", 0) + 1
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)


def _rows():
    g = torch.Generator().manual_seed(5)
    p1, p2 = torch.randint(3, 29, (7,), generator=g), torch.randint(3, 29, (4,), generator=g)
    prompts, lens = [p1, p1, p1, p2, p2, p2], (3, 6, 1, 5, 2, 4)
    Lp, Lc = 7, 6
    ids = torch.zeros(6, Lp + Lc, dtype=torch.long)
    am = torch.zeros(6, Lp + Lc, dtype=torch.long)
    for i, (p, n) in enumerate(zip(prompts, lens)):
        ids[i, Lp - len(p):Lp], am[i, Lp - len(p):Lp] = p, 1
        ids[i, Lp:Lp + n], am[i, Lp:Lp + n] = torch.randint(3, 29, (n,), generator=g), 1
    return ids, am, Lc


@pytest.mark.parametrize("cls", [MixedIn, Subclassed], ids=["mixin", "subclass"])
def test_a_logging_override_runs_and_its_super_call_takes_the_grouped_path(cls, model_dir, tmp_path):
    trainer = cls(model=model_dir, reward_funcs=_reward, train_dataset=_dataset(2), args=_config(tmp_path),
                  processing_class=word_tokenizer())
    ids, am, k = _rows()
    cmask = am[:, -k:].bool()

    def run():
        with torch.no_grad():
            return trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, k, batch_size=6,
                                                              compute_entropy=True)

    stock = run()
    assert trainer.logged_calls == 1
    patch_trainer(trainer, backend="sdpa")
    assert isinstance(trainer, cls)
    got = run()
    assert trainer.logged_calls == 2                         # the override still runs ...
    s = trainer.flexgroup_stats["old"]                       # ... and its super() call was grouped
    assert s["forwards"] == 1 and s["fallback_tokens"] == 0 and 0 < s["grouped_tokens"] < int(am.sum())
    for ours, ref in zip(got[:2], stock[:2]):
        torch.testing.assert_close(ours[cmask], ref[cmask], atol=1e-5, rtol=0)


def test_an_override_below_flexgroup_mixin_is_refused_with_the_fix(model_dir, tmp_path):
    class Wrong(FlexGroupMixin, Subclassed):   # the mixin above the override: the override would be bypassed
        pass

    class Right(LogsCalls, FlexGroupGRPOTrainer):
        pass

    trainer = Subclassed(model=model_dir, reward_funcs=_reward, train_dataset=_dataset(2), args=_config(tmp_path),
                         processing_class=word_tokenizer())
    trainer.__class__ = Wrong
    with pytest.raises(TypeError, match=r"Subclassed override\(s\) _get_per_token_logps_and_entropies below "
                                        r"FlexGroupMixin.*patch_trainer"):
        patch_trainer(trainer, backend="sdpa")
    trainer.__class__ = Right
    patch_trainer(trainer, backend="sdpa")                   # a wrapper above the adapter is fine


@needs_row_shuffle
def test_group_shuffle_advances_the_global_rng_as_trls_row_shuffle():
    from trl.trainer.utils import shuffle_sequence_dict

    p = torch.tensor([[5, 6]] * 3 + [[7, 8]] * 3 + [[1, 2]] * 3 + [[3, 4]] * 3)
    d = {"prompt_ids": p, "idx": torch.arange(12)}
    units = group_units(p, None, max_size=3)
    orders = set()
    for seed in range(6):
        torch.manual_seed(seed)
        shuffle_sequence_dict(d)
        stock_state = torch.get_rng_state()
        torch.manual_seed(seed)
        out = shuffle_groups(d, units)
        assert torch.equal(torch.get_rng_state(), stock_state)
        assert sorted(out["idx"].tolist()) == list(range(12))
        assert [len(u) for u in group_units(out["prompt_ids"], None, max_size=3)] == [3, 3, 3, 3]
        orders.add(tuple(out["idx"].tolist()))
    assert len(orders) > 1                                    # still shuffled


def _second_generation(cls, model_dir, tmp_path):
    """Completions (sorted rows) of the second generation batch, sampled with temperature 1."""
    trainer = cls(model=model_dir, reward_funcs=_reward, train_dataset=_dataset(4), args=_config(tmp_path),
                  processing_class=word_tokenizer())
    trainer.model.train()
    batches = iter(trainer.get_train_dataloader())
    torch.manual_seed(11)
    trainer._prepare_inputs(next(batches))
    trainer._step = trainer.args.steps_per_generation * trainer.num_iterations   # time for a new generation
    trainer._prepare_inputs(next(batches))
    rows = torch.cat([mb["completion_ids"] for mb in trainer._buffered_inputs]).tolist()
    return sorted(rows)


@needs_row_shuffle
def test_same_seed_samples_the_same_completions_as_stock_trl_at_the_next_generation(model_dir, tmp_path):
    class Grouped(FlexGroupGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, flexgroup_backend="sdpa", **kwargs)

    stock = _second_generation(trl.GRPOTrainer, model_dir, tmp_path / "stock")
    grouped = _second_generation(Grouped, model_dir, tmp_path / "grouped")
    assert grouped == stock
