"""TRL GRPO: the old-policy pass and the first update pass give bitwise equal log-probs (issue 43, item 2).

``num_iterations=2`` with ``steps_per_generation=2`` and ``gradient_accumulation_steps=2``: TRL computes the
old policy's log-probs over the generation batch in chunks of ``per_device_train_batch_size`` rows, in
generation order; the update then runs the same weights on micro-batches of whole groups in shuffled
order -- other rows packed together. The ratio ``exp(logp - old_logp)`` of the first optimizer step must
be exactly 1 on every completion token: checked with ``torch.equal``, and the packings are checked to
differ (otherwise the test would prove nothing).
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_trl import _config, _dataset, _fix_generations, _reward  # noqa: E402

from _trainers import save_tiny_llama, word_tokenizer  # noqa: E402
from flexgroup.integrations.trl import FlexGroupGRPOTrainer  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_ratio"))


class RatioProbe(FlexGroupGRPOTrainer):
    """Records every log-prob pass (grad enabled?, its rows, its log-probs) and each first-step micro-batch's
    (completion mask, old log-probs, policy log-probs)."""

    def __init__(self, *args, backend: str, **kwargs):
        super().__init__(*args, flexgroup_backend=backend, **kwargs)
        self.passes: list[tuple[bool, torch.Tensor, torch.Tensor]] = []
        self.first_step: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)
        self.passes.append((torch.is_grad_enabled(), input_ids.clone(), out[0].detach().clone()))
        return out

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.state.global_step == 0:
            self.first_step.append((inputs["completion_mask"].bool(), inputs["old_per_token_logps"],
                                    self.passes[-1][2]))
        return loss


@pytest.mark.parametrize("backend", ["lse", "sdpa"])
def test_first_update_pass_reproduces_the_old_policy_log_probs_bitwise(model_dir, tmp_path, backend):
    args = _config(tmp_path, steps_per_generation=2, gradient_accumulation_steps=2, num_iterations=2, beta=0.0,
                   loss_type="grpo")
    trainer = RatioProbe(model=model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset(4),
                         processing_class=word_tokenizer(), backend=backend)
    _fix_generations(trainer)
    trainer.train()
    old_chunks = [ids for grad, ids, _ in trainer.passes if not grad]
    update_rows = [ids for grad, ids, _ in trainer.passes if grad]
    assert len(trainer.first_step) == 2 and old_chunks and update_rows
    assert any(not any(u.shape == o.shape and torch.equal(u, o) for o in old_chunks) for u in update_rows[:2]), \
        "the update's micro-batches were packed like the old-policy chunks: nothing is tested"
    for mask, old, new in trainer.first_step:
        assert mask.any()
        assert torch.equal(new[mask], old[mask]), f"ratio != 1: max |logp - old| {(new - old)[mask].abs().max():.3g}"
