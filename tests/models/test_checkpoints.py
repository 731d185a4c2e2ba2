"""Tiny checkpoints (flexgroup.models.checkpoints): saved once into the cache folder, reused, seeded."""

import torch


def test_a_tiny_checkpoint_is_saved_once_into_the_cache_and_reused(tmp_path, monkeypatch):
    import os
    import tempfile

    from transformers import AutoModelForCausalLM

    from flexgroup.models.checkpoints import save_tiny_checkpoint

    monkeypatch.setenv("FLEXGROUP_CACHE", str(tmp_path / "cache"))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    # torch's own cache folder (inductor, first set up on the first model load of a process) is not ours
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    rng = torch.get_rng_state()
    first = save_tiny_checkpoint()
    stamp = {f: os.stat(os.path.join(first, f)).st_mtime_ns for f in os.listdir(first)}
    assert save_tiny_checkpoint() == first                       # reused, not rewritten
    assert {f: os.stat(os.path.join(first, f)).st_mtime_ns for f in os.listdir(first)} == stamp
    assert torch.equal(torch.get_rng_state(), rng)               # the caller's generator is untouched
    other = save_tiny_checkpoint(seed=1)
    reward = save_tiny_checkpoint(num_labels=1)
    assert len({first, other, reward}) == 3 and all(p.startswith(str(tmp_path / "cache")) for p in (first, other, reward))
    assert sorted(os.listdir(tmp_path / "cache" / "tiny-checkpoints")) == sorted(
        os.path.basename(p) for p in (first, other, reward))  # no half-written folders left
    assert list(scratch.iterdir()) == []                          # nothing in the temp folder
    explicit = save_tiny_checkpoint(str(tmp_path / "here"))      # an explicit path is written there
    a, b, c = (AutoModelForCausalLM.from_pretrained(p, local_files_only=True) for p in (first, explicit, other))
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)       # the weights follow the seed
