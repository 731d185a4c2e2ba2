"""A module drawing from its OWN ``torch.Generator`` during a grouped forward is refused, naming it.

The generator watch (:mod:`flexgroup.patches._random`) compares the default CPU generator and the
CUDA generators before and after a grouped forward; a module that draws with
``torch.rand(..., generator=self.gen)`` leaves those untouched, and its noise would be one shared draw
on a group's prompt (the repeated baseline draws per response). The watch now also snapshots every
``torch.Generator`` held as a module attribute and names the one that advanced. Broken variant:
with that snapshot emptied (the old watch), the same forward runs silently.
"""

from __future__ import annotations

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch
from flexgroup.patches import _random


class OwnNoise(torch.nn.Module):
    """Adds noise from its own generator (in eval mode too); ``used=False``: holds one, never draws."""

    def __init__(self, used: bool = True):
        super().__init__()
        self.gen = torch.Generator().manual_seed(3)
        self.used = used

    def forward(self, x):
        if not self.used:
            return x
        return x + 1e-3 * torch.rand(x.shape, generator=self.gen, dtype=x.dtype)


def _model(tiny_model, used=True):
    model = tiny_model("llama")
    model.model.norm = torch.nn.Sequential(model.model.norm, OwnNoise(used))
    return flexgroup.patch(model)


def _batch(groups):
    prompts, responses = groups([(9, [5, 3]), (4, [6])])
    return GroupedBatch.from_groups(prompts, responses)


def test_a_module_drawing_from_its_own_generator_is_refused_naming_it(tiny_model, groups):
    model, batch = _model(tiny_model), _batch(groups)
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match=r"own torch\.Generator 'norm\.1\.gen' advanced.*shared_prefix_dropout"):
        model(**batch.model_inputs())
    assert torch.equal(state, torch.get_rng_state())     # the default generator never moved: the old watch's blind spot
    flexgroup.patch(model, shared_prefix_dropout=True)  # the explicit opt-in
    model(**batch.model_inputs())


def test_a_generator_that_is_never_drawn_from_is_fine(tiny_model, groups):
    model, batch = _model(tiny_model, used=False), _batch(groups)
    model(**batch.model_inputs())
    assert [n for n, _ in _random.own_generators(model)] == ["model.norm.1.gen"]


def test_ungrouped_inputs_draw_as_they_like(tiny_model, groups):
    model, batch = _model(tiny_model), _batch(groups)
    with torch.no_grad():
        model(input_ids=batch.input_ids[None])


def test_broken_variant_without_the_snapshot_the_draw_goes_unseen(tiny_model, groups, monkeypatch):
    monkeypatch.setattr(_random, "_owned", lambda module: [])
    model, batch = _model(tiny_model), _batch(groups)
    model(**batch.model_inputs())   # silently one shared draw per prompt: what the snapshot refuses
