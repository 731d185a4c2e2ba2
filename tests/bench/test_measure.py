"""flexgroup.bench.measure, the one home of every benchmark's measuring: what each counter counts (no timings)."""

import json
import sys

import pytest
import torch

from flexgroup.bench import measure


def _leaves(n: int = 64):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g, requires_grad=True)    # [n, n] an activation
    w = torch.randn(n, n, generator=g, requires_grad=True)    # [n, n] a parameter
    return a, w


def test_saved_bytes_counts_what_autograd_saves_once_per_storage_and_skips_the_excluded():
    a, w = _leaves()
    # a @ w saves both operands for backward; a @ w again saves the same storages, counted once
    assert measure.saved_bytes(lambda: (a @ w) + (a @ w)) == a.nbytes + w.nbytes
    assert measure.saved_bytes(lambda: a @ w, exclude=[w]) == a.nbytes
    with torch.no_grad():
        assert measure.saved_bytes(lambda: a @ w) == 0


def test_saved_for_backward_labels_each_storage_by_its_first_tensor():
    a, w = _leaves()
    with measure.SavedForBackward(kind=lambda t: "w" if t is w else "other") as saved:
        out = a @ w
    assert saved.by_kind() == {"w": w.nbytes, "other": a.nbytes} and saved.bytes == a.nbytes + w.nbytes
    assert set(saved.storages) == {a.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}
    del out


def test_held_peak_is_the_most_held_at_once_not_the_sum_over_steps():
    a, w = _leaves()
    one = a.nbytes   # w excluded: each product holds a until its backward releases it

    def two_steps():
        for _ in range(2):
            (a @ w).sum().backward()

    tracker = measure.HeldForBackward([w])
    assert measure.held_peak(two_steps, tracker=tracker) == one
    assert tracker.live == 0   # every saved tensor was released by its backward
    # the control: two graphs alive at once hold twice as much
    assert measure.held_peak(lambda: ((a @ w).sum() + (a * 2 @ w).sum()).backward(), [w]) == 2 * one


def test_interleaved_medians_calls_every_step_warmup_plus_repeats_times_in_rounds():
    calls = []
    steps = {"x": lambda: calls.append("x"), "y": lambda: calls.append("y")}
    rec = measure.interleaved_medians(steps, repeats=3, warmup=1)
    assert calls == ["x", "y"] * 4
    assert set(rec) == {"x", "y"} and all(len(r["times_s"]) == len(r["cpu_s"]) == 3 for r in rec.values())
    assert all(set(r) == {"median_s", "times_s", "median_cpu_s", "cpu_s"} for r in rec.values())
    calls.clear()
    measure.time_interleaved(steps, repeats=3, warmup=0, alternate=True)
    assert calls == ["x", "y", "y", "x", "x", "y"]


def test_peak_rss_is_at_least_the_resident_size_and_json_is_written_where_asked(tmp_path):
    if sys.platform == "linux":
        assert measure.peak_rss_bytes() >= measure.rss_bytes() > 0
    else:   # the resident size is read from /proc: elsewhere it is refused, not guessed
        with pytest.raises(OSError, match="VmRSS"):
            measure.rss_bytes()
    path = tmp_path / "new" / "rec.json"
    measure.write_json({"dtype": torch.float32, "n": 1}, path)
    assert json.loads(path.read_text()) == {"dtype": "torch.float32", "n": 1}
