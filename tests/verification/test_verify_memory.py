"""verify bounds its own memory (issue 31, item 2): tested under address-space caps in a child process.

The child (``_verify_memory_child.py``) builds a random Llama of ``M`` bytes whose weights are mostly its
embeddings (the shape where verify's copies and gradient sets dominate), warms verify up, then runs it
under ``RLIMIT_AS`` = its virtual size after the warm-up (the model included) plus a multiple of ``M``.
glibc is told to map every allocation of 128 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_``), so
freed tensors leave the address space at once and the cap measures what verify holds, not the
allocator's reuse of freed heap.

- calibration none fits in the model + 3 M (two gradient sets, activations and one gradient's
  accumulation in flight); the copies as verify made them before (each deep-copying the weights)
  do not -- the broken variant;
- auto never exceeds the cap: it picks none / layerwise / float64 from what it measured and what is
  left, and says why; a forced float64 copy runs out of memory under a cap auto stays within.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("_verify_memory_child.py")
# the runs expected to fail come last: a run that failed mid-way may leave garbage behind
ARGS = ["none:3", "auto:3", "auto:6", "auto:9", "float64:4", "none:3:unshared"]


@pytest.fixture(scope="module")
def runs():
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux's /proc (virtual size, peak resident set)")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(CHILD), *ARGS], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return {r["arg"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])["runs"]}


def test_calibration_none_fits_in_three_model_sizes_beside_the_model(runs):
    assert "error" not in runs["none:3"], runs["none:3"]
    assert runs["none:3"]["ok"] and runs["none:3"]["calibration"] == "none"


def test_copies_that_duplicate_the_weights_run_out_under_the_same_cap(runs):
    assert "can't allocate memory" in runs["none:3:unshared"].get("error", ""), runs["none:3:unshared"]


def test_auto_never_exceeds_the_cap_and_says_what_it_chose_and_why(runs):
    tight, middle, roomy = runs["auto:3"], runs["auto:6"], runs["auto:9"]
    for r in (tight, middle, roomy):
        assert "error" not in r and r["ok"], r
    assert tight["calibration"] == "none"
    assert any("calibration auto -> none" in n and "address-space limit" in n for n in tight["notes"]), tight
    assert middle["calibration"] == "layerwise"
    assert any("calibration auto -> layerwise" in n for n in middle["notes"]), middle
    assert roomy["calibration"] == "float64"


def test_a_forced_float64_copy_runs_out_under_a_cap_that_auto_stays_within(runs):
    # the copy alone is 2 M beside the two gradient sets: 4 M cannot hold it; auto at 3 M ran
    assert "can't allocate memory" in runs["float64:4"].get("error", ""), runs["float64:4"]
