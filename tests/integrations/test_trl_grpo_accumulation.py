"""Gradient accumulation over micro-batches of whole groups gives stock TRL's update.

With ``steps_per_generation = gradient_accumulation_steps = 2`` the adapter's micro-batches hold other
rows than stock TRL's (whole groups vs single rows), yet for losses normalised by the micro-batch's
row count (all micro-batches equally large) or by the whole generation batch's token count the
accumulated gradient is the same. Oracle: stock ``GRPOTrainer``, same seed, same (replayed)
completions; compared: every parameter gradient after the accumulation window (float32).
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_trl import G, Baseline, Grouped, _config, _dataset, _fix_generations, _reward  # noqa: E402

from _trainers import save_tiny_llama, word_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_accum"))


def _grads(cls, model_dir, tmp_path, loss_type):
    args = _config(tmp_path, steps_per_generation=2, gradient_accumulation_steps=2, num_iterations=1,
                   loss_type=loss_type)
    trainer = cls(model=model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset(4),
                  processing_class=word_tokenizer())
    _fix_generations(trainer)
    trainer.train()
    return trainer.recorded_grads


def _trl_knows(loss_type: str) -> bool:
    import inspect
    import sys

    return f'"{loss_type}"' in inspect.getsource(sys.modules[trl.GRPOTrainer.__module__])


@pytest.mark.parametrize("loss_type", [
    "grpo", pytest.param("dapo", marks=pytest.mark.skipif(not _trl_knows("dapo"), reason="this TRL has no loss "
                                                          "type 'dapo' (added after TRL 0.20)"))])
def test_accumulated_gradient_over_whole_group_micro_batches_equals_stock(model_dir, tmp_path, loss_type):
    base = _grads(Baseline, model_dir, tmp_path / "base", loss_type)
    grp = _grads(Grouped, model_dir, tmp_path / "grp", loss_type)
    assert base.keys() == grp.keys() and len(base) > 0
    for name, gb in base.items():
        scale = gb.abs().max().item()
        err = (grp[name] - gb).abs().max().item()
        assert scale > 0 and err <= 1e-4 * scale + 1e-8, f"{name}: max |grad diff| {err:.3g}, grad scale {scale:.3g}"


def test_bnpo_normalised_per_micro_batch_differs_as_documented(model_dir, tmp_path):
    """bnpo divides by each micro-batch's token count, which depends on the split: the oracle above
    can tell two splits apart (docs/trl.md states this difference)."""
    base = _grads(Baseline, model_dir, tmp_path / "base", "bnpo")
    grp = _grads(Grouped, model_dir, tmp_path / "grp", "bnpo")
    worst = max((grp[n] - g).abs().max().item() / g.abs().max().item() for n, g in base.items())
    assert worst > 1e-3
