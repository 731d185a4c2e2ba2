"""benchmarks/gpu_check.py --toy runs end to end on CPU (the GPU script must not rot between GPU runs)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.compiled
@pytest.mark.slow
def test_gpu_check_toy_runs_and_reports_exactness_first(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    threads = torch.get_num_threads()
    try:
        assert mod.main(["--toy", "--repeats", "1", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "gpu_check-toy-cpu.json").read_text())
    assert data["exactness"]["float32"]["ok"] and data["exactness"]["tree_float32"]["ok"]
    assert data["exactness"]["tree_float32"]["packed_tokens"] < data["exactness"]["tree_float32"]["tokens_one_by_one"]
    assert data["model_points"][0]["results"]["flexgroup"]["speedup"] > 0
    assert data["largest_group"]["largest_fitting"] >= 2
    assert data["exactness"]["stream_float32"]["ok"] and data["streamed_group"]["largest_fitting"] >= 2
    md = (tmp_path / "gpu_check-toy-cpu.md").read_text()
    assert "## 1. Exactness" in md and "P5" in md and "P6" in md and "P10" in md
    # issue 43: lse is invariant to the trie around a sequence; sdpa only to row-mates (docs/batch-invariance.md)
    assert data["invariance"]["lse"]["invariant"] and "invariant" in data["invariance"]["sdpa"]
    assert "batch invariance (issue 43), bf16, lse: bitwise" in md


def test_gpu_check_p10_streams_a_tree_batch_of_doubling_user_prompts_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.gpu_bench.toy_config(2)
    out = mod._largest_streamed_group(cfg, "cpu", 200, 8, 1, 2, 128, lambda s: None, workload="tree")
    assert out["workload"] == "tree" and out["largest_fitting"] == 2
    # G counts user prompts: 8 trajectories each, every tree larger than the 128-token budget
    assert [r["sequences"] for r in out["per_G"].values()] == [8, 16]
    assert all(r["tokens"] > 4 * 128 for r in out["per_G"].values())


def test_gpu_check_toy_traces_its_cuda_branches_on_fake_cuda_tensors():
    """The toy run's CUDA paths (model points for flex / lse / sdpa, needed logits, streaming, attention, the
    hybrid) on fake cuda tensors: every output on cuda with the expected dtype and shape, no mixed-device op."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fake_cuda_trace
    import gpu_bench

    cfg = gpu_bench.toy_config(2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = fake_cuda_trace.run(cfg, 24, 6, 3, lambda: gpu_bench.build(cfg, torch.float32, "cpu"), lambda s: None)
    finally:
        torch.set_num_threads(threads)
    if "skipped" in out:
        pytest.skip(out["skipped"])
    assert out["ok"], out["cases"]
    assert {"model group flex", "model tree lse", "stream_logprobs over budget (P10)"} <= set(out["cases"])
