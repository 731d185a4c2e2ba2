"""The one GPU check: exactness first, then speed (P1, P2, P5, P6, P10), in well under 8 minutes on an H200.

    python benchmarks/gpu_check.py                       # CUDA (H200-class); writes ./gpu_check-results/
    python benchmarks/gpu_check.py --out benchmarks/results   # record a run in the repository
    python benchmarks/gpu_check.py --toy                 # CPU, toy sizes (CI keeps the script alive); its CUDA
                                                         #   branches also traced on fake cuda tensors
    torchrun --nproc-per-node 4 benchmarks/gpu_check.py --sequence-parallel   # multi-GPU recipe (untested)

Install on a bare GPU machine without internet: ``pip install --no-deps --no-build-isolation -e .``.

1. Exactness (the script stops before timing anything if one fails), each against the stock model run
   one sequence at a time (:func:`flexgroup.verify`, the shared oracle):
   a Qwen3-4B-shaped random model with 2 layers in float32 (log-probs and every gradient) and bf16
   (flexgroup's bf16 error against a float32 run must be within 2x the baseline's own bf16 error);
   a tree batch (multi-turn, shared system prompt); a hybrid (Qwen3.5-shaped, Gated DeltaNet) when
   ``flexgroup.patches.hybrid`` is present -- it records whether fla / causal-conv1d fast kernels were used;
   ``flexgroup.stream_backward`` with a prompt longer than the budget (log-probs and every gradient).
2. P1: the Qwen3-4B shape with ``--layers`` layers, G=8, P=8192, R=512 (and P=4096, R=256):
   forward+backward of the log-prob pass, speedup vs the ideal FLOPs ratio, vs the PrefixGrouper
   algorithm, peak memory vs the baseline (``benchmarks/gpu_bench.py``'s model point).
3. P2: grouped flex attention vs dense causal flex of the same length, useful-FLOP throughput, and
   beside them the compile-free ``lse`` backend (fused flash / memory-efficient parts merged by
   log-sum-exp; P1 times it too, as ``flexgroup-lse``).
4. P5: compiles over 20 steps of varying lengths (dynamo's unique graphs before/after).
5. P6: the largest G that fits at P=8192, R=512 (doubling until out of memory), with memory per G.
6. P10: the same with ``flexgroup.stream_backward`` under a budget of 16,384 tokens per forward: the
   largest G that fits streamed, peak memory and seconds per step for each G. ``--p10-workload tree``:
   instead of one group, a tree batch (``flexgroup bench stream --workload tree``'s shape): the 8,192-token
   system prompt shared by G user prompts of 512-1,024 tokens, each with 8 three-turn trajectories
   (assistant 256-512, tool 512-1,024 tokens; branches at turn 1, mid turn 2, before turn 3), doubling
   the user prompts from 1 until out of memory.

Writes one markdown table and one JSON (``gpu_check-<device>-<date>.{md,json}``).

``--sequence-parallel`` (under ``torchrun``, several GPUs; not runnable on the one-GPU machine this was
written for, so untested): Ulysses sequence parallelism over all ranks -- a small tree sharded versus
unsharded (log-probs and gradients), then per-rank memory of a ``--sp-tokens`` tree
(``benchmarks/sp_memory.py``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_cuda_trace  # noqa: E402  (--toy: the CUDA branches on fake cuda tensors)
import gpu_bench  # noqa: E402  (the model and attention points live there)

import flexgroup  # noqa: E402
from flexgroup import GroupedBatch, Layout  # noqa: E402
from flexgroup.bench.measure import environment, write_json  # noqa: E402
from flexgroup.bench.contenders import make_group, pg_available, qwen3_4b_config  # noqa: E402
from flexgroup.bench.stream_workloads import tree_batch  # noqa: E402
from flexgroup.reference.oracle import logprobs_alone  # noqa: E402


def _exactness(cfg, device, P, R, G, log) -> dict:
    """float32 and bf16 verify of a random model of ``cfg``'s shape; a tree batch; raises on failure."""
    out = {}
    m32 = gpu_bench.build(cfg, torch.float32, device).eval()
    prompt, responses = make_group(P, [R] * G, cfg.vocab_size, seed=1)
    batch = GroupedBatch.from_groups([prompt], [responses])
    rep = flexgroup.verify(m32, batch, dtype=torch.float32)
    out["float32"] = {"ok": rep.ok, "table": rep.table()}
    log(rep.table())
    rep = flexgroup.verify(m32, batch, dtype=torch.float32, backend="lse")  # fused parts merged by LSE
    out["float32_lse"] = {"ok": rep.ok, "table": rep.table()}
    log("backend lse:\n" + rep.table())
    # a multi-turn tree: one system prompt, two groups, branches mid-turn
    g = torch.Generator().manual_seed(2)
    rnd = lambda n: torch.randint(1, cfg.vocab_size, (n,), generator=g)  # noqa: E731
    sys_p, tasks = rnd(P // 2), [rnd(P // 4) for _ in range(2)]
    seqs = []
    for t in tasks:
        turn = rnd(R)
        seqs += [torch.cat([sys_p, t, turn, rnd(R)]), torch.cat([sys_p, t, turn, rnd(R // 2)]), torch.cat([sys_p, t, rnd(R)])]
    tree_batch = GroupedBatch.from_sequences(seqs)
    tree = flexgroup.verify(m32, tree_batch, dtype=torch.float32)
    out["tree_float32"] = {"ok": tree.ok, "table": tree.table(), "packed_tokens": tree_batch.num_tokens,
                           "tokens_one_by_one": sum(len(s) for s in seqs)}
    log(tree.table())
    tree = flexgroup.verify(m32, tree_batch, dtype=torch.float32, backend="lse")
    out["tree_float32_lse"] = {"ok": tree.ok, "table": tree.table()}
    log("backend lse:\n" + tree.table())
    # bf16: flexgroup's error against a float32 run, next to the baseline's own bf16 error
    with torch.no_grad():
        inputs = batch.model_inputs(device)
        m16 = gpu_bench.build(cfg, torch.bfloat16, device).eval()
        m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in m32.state_dict().items()})
        lp_truth = torch.stack([logprobs_alone(m32, torch.cat([prompt, r]))[P - 1:] for r in responses])
        lp_alone = torch.stack([logprobs_alone(m16, torch.cat([prompt, r]))[P - 1:] for r in responses])
        flexgroup.patch(m16)
        lp16 = batch.logprobs(m16(**inputs).logits.float())
        flexgroup.patch(m16, backend="lse")
        lp16_lse = batch.logprobs(m16(**inputs).logits.float())
    base_err = (lp_alone - lp_truth).abs().max().item()
    grp_err = (lp16 - lp_truth).abs().max().item()
    lse_err = (lp16_lse - lp_truth).abs().max().item()
    out["bfloat16"] = {"ok": grp_err <= 2 * base_err + 1e-3, "flexgroup_err_vs_f32": grp_err,
                       "baseline_err_vs_f32": base_err}
    out["bfloat16_lse"] = {"ok": lse_err <= 2 * base_err + 1e-3, "flexgroup_err_vs_f32": lse_err,
                           "baseline_err_vs_f32": base_err}
    log(f"bf16: flexgroup log-prob error vs float32 {grp_err:.3g} (backend lse {lse_err:.3g}), "
        f"stock bf16 model's own {base_err:.3g}")
    return out


def _invariance(cfg, device, log, P=512, R=64, G=4) -> dict:
    """Issue 43 (measured, not a gate): a group's bf16 log-probs alone vs packed beside a same-shaped group
    (:func:`flexgroup.verification.invariance.check_batch_invariance`), per backend; docs/batch-invariance.md."""
    from flexgroup.verification.invariance import check_batch_invariance

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size, (P,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(3, cfg.vocab_size, (R + 7 * i,), generator=g)]) for i in range(G)]
    out = {}
    for backend in ("flex", "lse") if device == "cuda" else ("lse", "sdpa"):
        rep = check_batch_invariance(flexgroup.patch(gpu_bench.build(cfg, torch.bfloat16, device), backend=backend), seqs)
        log(f"batch invariance, backend {backend}, bf16, P={P}, G={G}:\n{rep}")
        out[backend] = {"invariant": rep.invariant, "arrangements": [vars(a) for a in rep.arrangements],
                        "linear_rows": rep.linear_rows}
    return out


def _hybrid_exactness(device, log) -> dict:
    from flexgroup.models.zoo import build_model, unavailable

    if unavailable("qwen3_5_text"):
        return {"skipped": unavailable("qwen3_5_text")}
    kernels = {}
    for mod in ("fla", "causal_conv1d", "mamba_ssm"):
        try:
            __import__(mod)
            kernels[mod] = True
        except ImportError:
            kernels[mod] = False
    m = build_model("qwen3_5_text", dtype=torch.float32).to(device)
    prompt, responses = make_group(96, [1, 3, 70], m.config.vocab_size, seed=3)
    rep = flexgroup.verify(m, GroupedBatch.from_groups([prompt], [responses]), dtype=torch.float32)
    log(rep.table())
    return {"ok": rep.ok, "table": rep.table(), "fast_kernels_importable": kernels}


def _flex_refused(cfg, device, dtype) -> str | None:
    """The reason compiled flex is refused on this device (the CPU kernel self-check), or None."""
    lay = Layout.group(16, [4, 4])
    q = torch.randn(1, cfg.num_attention_heads, lay.num_tokens, cfg.head_dim, device=device, dtype=dtype)
    k = torch.randn(1, cfg.num_key_value_heads, lay.num_tokens, cfg.head_dim, device=device, dtype=dtype)
    try:
        with torch.no_grad():
            flexgroup.attention(q, k, k, lay, backend="flex")
    except NotImplementedError as e:
        return str(e)
    return None


def _compiles(cfg, device, dtype, steps, max_len, log) -> dict:
    """P5: ``steps`` varying lengths, each through a ``no_grad`` pass and (CUDA) a forward+backward pass,
    as a GRPO step's old-policy and policy passes; the graphs flexgroup's compiled flex kernels built,
    per kernel key (``flexgroup.kernels.flex.compiled_graphs``), and whether the sdpa fallback fired.

    Target (benchmarks/README.md, compile budget): at most 2 graphs per key, none after the 2nd length."""
    from torch._dynamo.utils import counters

    from flexgroup.kernels import flex

    g = torch.Generator().manual_seed(5)
    before = counters["stats"]["unique_graphs"]
    train = torch.device(device).type == "cuda"
    times, after_step = [], []
    for _ in range(steps):
        P = int(torch.randint(max_len // 8, max_len // 2, (1,), generator=g))
        rs = torch.randint(max_len // 64, max_len // 8, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
        lay = Layout.group(P, rs.tolist())
        mk = lambda h, grad: torch.randn(1, h, lay.num_tokens, cfg.head_dim, device=device, dtype=dtype,  # noqa: E731
                                         requires_grad=grad)
        t = time.perf_counter()
        for grad in ([False, True] if train else [False]):
            q, k, v = mk(cfg.num_attention_heads, grad), mk(cfg.num_key_value_heads, grad), mk(cfg.num_key_value_heads, grad)
            with torch.set_grad_enabled(grad):
                o = flexgroup.attention(q, k, v, lay, backend="flex")
                if grad:
                    o.sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        after_step.append(sum(flex.compiled_graphs().values()))
    per_key = {str(k[1:]): n for k, n in flex.compiled_graphs().items()}
    n = counters["stats"]["unique_graphs"] - before
    fallback = flex._FALLBACK.get("why")
    ok = fallback is None and max(per_key.values(), default=0) <= 2 and after_step[-1] == after_step[min(1, steps - 1)]
    log(f"P5: {steps} steps of varying lengths -> {n} new dynamo graphs; flex graphs per key {per_key}; "
        f"after each step {after_step}; sdpa fallback: {fallback or 'never'}; step times {['%.2f' % x for x in times]}")
    return {"steps": steps, "new_graphs": n, "graphs_per_key": per_key, "graphs_after_step": after_step,
            "fallback": fallback, "ok": ok, "step_s": times}


def _flash_parity(cfg, device, log, launches: int = 200, P: int = 4096, R: int = 512, G: int = 8) -> dict:
    """FlexAttention's FLASH backend (``kernel_options={"BACKEND": "FLASH"}``, torch >= 2.10, CuTe /
    FlashAttention-4) beside the default Triton kernel on flexgroup's block mask: outputs and q/k/v
    gradients against a float32 Triton run, then gradient parity over ``launches`` backward launches
    (a Hopper backward race corrupted 0.1-1 % of masked launches until August 2026), then timing.

    A launch fails when its bf16 error against the float32 run exceeds 2x the Triton bf16 error + 1e-3.
    Skipped (with the reason) off CUDA or where the build has no FLASH backend."""
    from torch.nn.attention.flex_attention import flex_attention

    from flexgroup.layout.masks import block_mask

    if device != "cuda":
        return {"skipped": "needs CUDA"}
    lay = Layout.group(P, [R] * G)
    bm = block_mask(lay, device=device)
    fn = torch.compile(flex_attention)
    gen = torch.Generator(device=device).manual_seed(7)
    L, D, H = lay.num_tokens, cfg.head_dim, cfg.num_attention_heads
    # q/k/v with H heads each (K/V of a GQA model repeated): FLASH's GQA support varies across builds
    base = [torch.randn(1, H, L, D, device=device, generator=gen) for _ in range(3)]
    dout = torch.randn(1, H, L, D, device=device, generator=gen)

    def run(dtype, options):
        q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in base)  # fresh leaves each launch
        o = fn(q, k, v, block_mask=bm, kernel_options=options)
        o.backward(dout.to(dtype))
        return [x.float() for x in (o.detach(), q.grad, k.grad, v.grad)]

    truth = run(torch.float32, None)
    triton = run(torch.bfloat16, None)
    err = lambda got: max(float((a - b).abs().max()) for a, b in zip(got, truth))  # noqa: E731
    tri_err = err(triton)
    try:
        flash = run(torch.bfloat16, {"BACKEND": "FLASH"})
    except Exception as e:  # noqa: BLE001 -- a build without the FLASH backend: say so
        log(f"FLASH backend unavailable: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
        return {"skipped": f"FLASH backend unavailable: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
                "triton_err_vs_f32": tri_err}
    tol = 2 * tri_err + 1e-3
    bad, worst = [], err(flash)
    for i in range(launches):
        e = err(run(torch.bfloat16, {"BACKEND": "FLASH"}))
        worst = max(worst, e)
        if not e <= tol:
            bad.append((i, e))
    ok = not bad and err(flash) <= tol
    log(f"FLASH vs Triton on a {L}-token group: Triton bf16 error vs float32 {tri_err:.3g}; FLASH {err(flash):.3g}; "
        f"{launches} backward launches: {len(bad)} beyond {tol:.3g} (worst {worst:.3g}) -> {'pass' if ok else 'FAIL'}")
    out = {"tokens": L, "triton_err_vs_f32": tri_err, "flash_err_vs_f32": err(flash), "launches": launches,
           "bad_launches": bad[:20], "num_bad": len(bad), "worst_err": worst, "tol": tol, "ok": ok}
    if ok:  # timing only after correctness
        for name, opts in (("triton", None), ("flash", {"BACKEND": "FLASH"})):
            ts = []
            for _ in range(5):
                torch.cuda.synchronize()
                t = time.perf_counter()
                run(torch.bfloat16, opts)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t)
            out[f"{name}_fwd_bwd_s"] = sorted(ts)[2]
        out["flash_speedup"] = out["triton_fwd_bwd_s"] / out["flash_fwd_bwd_s"]
        log(f"FLASH fwd+bwd {out['flash_fwd_bwd_s'] * 1e3:.2f} ms vs Triton {out['triton_fwd_bwd_s'] * 1e3:.2f} ms "
            f"({out['flash_speedup']:.2f}x)")
    return out


def _largest_group(cfg, device, P, R, G0, G_max, log) -> dict:
    """P6: double G until out of memory (CUDA) -- forward+backward of the patched model's log-prob pass."""
    m = flexgroup.patch(gpu_bench.build(cfg, torch.bfloat16, device))
    res, G = {}, G0
    while G <= G_max:
        prompt, responses = make_group(P, [R] * G, cfg.vocab_size)
        batch = GroupedBatch.from_groups([prompt], [responses])
        try:
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            m.zero_grad(set_to_none=True)
            batch.logprobs(m(**batch.model_inputs(device, needed_logits_only=True)).logits).sum().backward()
            peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
            res[G] = {"fits": True, "peak_bytes": peak}
            log(f"P6: G={G} fits" + (f", peak {peak / 2**30:.1f} GiB" if peak else ""))
        except torch.cuda.OutOfMemoryError:
            res[G] = {"fits": False}
            log(f"P6: G={G} out of memory")
            break
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        G *= 2
    fit = [g for g, r in res.items() if r["fits"]]
    out = {"per_G": res, "largest_fitting": max(fit) if fit else None}
    peaks = [(g, r["peak_bytes"]) for g, r in res.items() if r.get("peak_bytes")]
    if len(peaks) >= 2 and device == "cuda":
        (g0, p0), (g1, p1) = peaks[-2], peaks[-1]
        per_g = (p1 - p0) / (g1 - g0)
        total = torch.cuda.get_device_properties(0).total_memory
        out["bytes_per_response"] = per_g
        out["extrapolated_max_G"] = int(g1 + (total * 0.95 - p1) / per_g) if per_g > 0 else None
    return out


def _stream_exactness(cfg, device, log, P=300, R=40, G=3, budget=128) -> dict:
    """stream_backward (prompt longer than the budget) vs each sequence alone: log-probs and every gradient."""
    model = gpu_bench.build(cfg, torch.float32, device).eval()
    stock = copy.deepcopy(model)  # its own config: patching must not switch the stock copy
    flexgroup.patch(model)
    prompt, responses = make_group(P, [R] * G, cfg.vocab_size, seed=3)
    seqs = [torch.cat([prompt, r]) for r in responses]
    w = torch.linspace(-1.0, 1.0, G, device=device)
    res = flexgroup.stream_backward(model, seqs, lambda lp, i: (lp * w[i, None]).sum(), budget=budget)
    err = 0.0
    for i, s in enumerate(seqs):
        lp = logprobs_alone(stock, s)
        err = max(err, (lp.cpu() - res.logprobs[i, 1:s.numel()]).abs().max().item())
        (lp * w[i]).sum().backward()
    rel = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
              for p, q in zip(model.parameters(), stock.parameters()))
    ok = err <= 1e-4 and rel <= 1e-3
    log(f"stream_backward (P={P} > budget={budget}, {res.forwards} forwards): log-prob err {err:.2g}, "
        f"max grad rel err {rel:.2g} ({'pass' if ok else 'FAIL'})")
    return {"ok": ok, "logprob_err": err, "grad_rel_err": rel, "forwards": res.forwards}


def _p10_batch(workload: str, P: int, R: int, G: int, vocab: int):
    """``(sequences, loss_masks)``: ``group``, one P-token prompt and G responses of R; ``tree``, a P-token
    system prompt shared by G user prompts (R..2R tokens), 8 three-turn trajectories each (assistant
    R/2..R, tool R..2R tokens; loss on assistant tokens)."""
    if workload == "tree":
        seqs, masks, _ = tree_batch(P, G, (R, 2 * R), (R // 2, R), (R, 2 * R), vocab=vocab)
        return seqs, masks
    prompt, responses = make_group(P, [R] * G, vocab)
    seqs = [torch.cat([prompt, r]) for r in responses]
    return seqs, [torch.arange(s.numel()) >= P for s in seqs]


def _largest_streamed_group(cfg, device, P, R, G0, G_max, budget, log, workload: str = "group") -> dict:
    """P10: double G (responses, or user prompts of a tree) until out of memory with stream_backward
    under ``budget`` tokens per forward."""
    m = flexgroup.patch(gpu_bench.build(cfg, torch.bfloat16, device))
    res, G = {}, G0
    while G <= G_max:
        seqs, masks = _p10_batch(workload, P, R, G, cfg.vocab_size)
        try:
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            m.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            flexgroup.stream_backward(m, seqs, lambda lp, i: lp.sum(), loss_masks=masks, budget=budget)
            if device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
            res[G] = {"fits": True, "peak_bytes": peak, "step_s": dt, "sequences": len(seqs),
                      "tokens": sum(s.numel() for s in seqs)}
            log(f"P10 ({workload}): G={G} fits streamed (budget {budget}), {dt:.2f} s"
                + (f", peak {peak / 2**30:.1f} GiB" if peak else ""))
        except torch.cuda.OutOfMemoryError:
            res[G] = {"fits": False}
            log(f"P10 ({workload}): G={G} out of memory streamed")
            break
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        G *= 2
    fit = [g for g, r in res.items() if r["fits"]]
    return {"workload": workload, "budget": budget, "per_G": res, "largest_fitting": max(fit) if fit else None}


def to_markdown(data: dict) -> str:
    env = data["env"]
    lines = [f"# flexgroup GPU check{' (toy, CPU)' if data['toy'] else ''}", "",
             f"- date: {env['date']}; device: {env.get('gpu') or env.get('cpu')} ({env['device']})",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
             f"- wall: {data['wall_s']:.0f} s", "", "## 1. Exactness", ""]
    ex = data["exactness"]
    lines += [f"- float32 verify: {'pass' if ex['float32']['ok'] else 'FAIL'}; tree batch: "
              f"{'pass' if ex['tree_float32']['ok'] else 'FAIL'}",
              f"- bf16 log-prob error vs float32: flexgroup {ex['bfloat16']['flexgroup_err_vs_f32']:.3g}, stock bf16 "
              f"model alone {ex['bfloat16']['baseline_err_vs_f32']:.3g} ({'pass' if ex['bfloat16']['ok'] else 'FAIL'})",
              f"- backend lse: float32 verify {'pass' if ex['float32_lse']['ok'] else 'FAIL'}; tree batch "
              f"{'pass' if ex['tree_float32_lse']['ok'] else 'FAIL'}; bf16 log-prob error vs float32 "
              f"{ex['bfloat16_lse']['flexgroup_err_vs_f32']:.3g} ({'pass' if ex['bfloat16_lse']['ok'] else 'FAIL'})",
              f"- stream_backward (prompt > budget): {'pass' if ex['stream_float32']['ok'] else 'FAIL'} "
              f"(log-prob err {ex['stream_float32']['logprob_err']:.2g}, grad rel err "
              f"{ex['stream_float32']['grad_rel_err']:.2g})",
              f"- CUDA branches on fake cuda tensors (--toy): {_fake_markdown(data.get('fake_cuda', {}))}",
              f"- hybrid: {data['hybrid'].get('skipped') or ('pass' if data['hybrid']['ok'] else 'FAIL')}"
              + (f"; fast kernels importable: {data['hybrid']['fast_kernels_importable']}"
                 if "fast_kernels_importable" in data["hybrid"] else "")]
    lines += [f"- batch invariance (issue 43), bf16, {b}: "
              + ("bitwise" if r["invariant"] else "NOT bitwise: " + "; ".join(
                  f"{x['name']} {x['max_abs_diff']:.2g}" for x in r["arrangements"] if not x["logprobs_equal"]))
              for b, r in data.get("invariance", {}).items()] + [""]
    body = gpu_bench.to_markdown(dict(env=env, toy=data["toy"], dtype=data["dtype"], repeats=data["repeats"],
                                      model=data["model"], check=data["check"], model_points=data["model_points"],
                                      attention_points=data["attention_points"]))
    lines += ["## 2-3. P1 (model) and P2 (attention)", ""] + body.split("\n")[1:]
    p5, p6 = data["compiles"], data["largest_group"]
    lines += ["## 4. P5: compiles over varying lengths", "",
              f"skipped: {p5['skipped']}" if "skipped" in p5 else
              f"{p5['steps']} steps, {p5['new_graphs']} new compiled graphs; flex graphs per kernel key "
              f"{p5.get('graphs_per_key')}; sdpa fallback: {p5.get('fallback') or 'never'}; "
              f"{'pass' if p5.get('ok') else 'FAIL'} (<= 2 per key, none after the 2nd length); first step "
              f"{p5['step_s'][0]:.2f} s, median of the rest {sorted(p5['step_s'][1:])[len(p5['step_s'][1:]) // 2]:.3f} s",
              "", "## 4b. FLASH (CuTe / FA4) backend beside Triton", "", _flash_markdown(data.get("flash", {})), "",
              "## 5. P6: largest G", "",
              f"largest G that fits: {p6['largest_fitting']}; bytes per response: {p6.get('bytes_per_response')}; "
              f"extrapolated max G: {p6.get('extrapolated_max_G')}", ""]
    p10 = data["streamed_group"]
    what = "user prompts of the tree" if p10.get("workload") == "tree" else "G"
    lines += ["## 6. P10: largest G streamed", "",
              f"workload {p10.get('workload', 'group')}; budget {p10['budget']} tokens per forward; largest "
              f"{what} that fits: {p10['largest_fitting']}", "",
              "| G | fits | seconds | peak GiB |", "|---|---|---|---|"]
    for g, r in p10["per_G"].items():
        pk = r.get("peak_bytes")
        lines.append(f"| {g} | {r['fits']} | {r.get('step_s', float('nan')):.2f} | "
                     f"{pk / 2**30:.1f} |" if pk else f"| {g} | {r['fits']} | {r.get('step_s', float('nan')):.2f} | - |")
    lines.append("")
    return "\n".join(lines)


def _fake_markdown(fk: dict) -> str:
    if "skipped" in fk or not fk:
        return f"skipped ({fk.get('skipped', 'not run')})"
    bad = [k for k, v in fk["cases"].items() if v != "ok"]
    return f"{len(fk['cases'])} paths, " + ("all on cuda, no mixed-device op" if not bad else f"FAIL: {bad}")


def _flash_markdown(fl: dict) -> str:
    if "skipped" in fl:
        return f"skipped: {fl['skipped']}"
    text = (f"{fl['tokens']} tokens: bf16 error vs float32 Triton {fl['triton_err_vs_f32']:.3g}, FLASH "
            f"{fl['flash_err_vs_f32']:.3g}; {fl['launches']} backward launches, {fl['num_bad']} beyond {fl['tol']:.3g} "
            f"(worst {fl['worst_err']:.3g}): {'pass' if fl['ok'] else 'FAIL'}")
    if "flash_speedup" in fl:
        text += (f"; fwd+bwd FLASH {fl['flash_fwd_bwd_s'] * 1e3:.2f} ms vs Triton {fl['triton_fwd_bwd_s'] * 1e3:.2f} ms "
                 f"({fl['flash_speedup']:.2f}x)")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toy", action="store_true", help="CPU, toy sizes (under a minute)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="gpu_check-results", help="output folder (default ./gpu_check-results)")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="under torchrun on several GPUs: Ulysses sequence-parallel exactness and memory")
    ap.add_argument("--sp-tokens", type=int, default=32768)
    ap.add_argument("--p10-workload", choices=("group", "tree"), default="group",
                    help="P10: one group (default) or a tree batch of G user prompts under one system prompt")
    args = ap.parse_args(argv)
    if args.sequence_parallel:
        import sp_memory

        return sp_memory.torchrun_main(args.sp_tokens, args.layers)
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    if args.toy:
        device, dtype, cfg, check_cfg = "cpu", torch.float32, gpu_bench.toy_config(2), gpu_bench.toy_config(2)
        points, G, check_size, p5, p6 = [(64, 16)], 4, (24, 6, 3), (2, 120), (32, 8, 2, 4)
        p10 = (300, 16, 2, 4, 128) if args.p10_workload == "group" else (300, 16, 1, 2, 128)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --toy on CPU", file=sys.stderr)
            return 2
        device, dtype, cfg = "cuda", torch.bfloat16, qwen3_4b_config(args.layers)
        check_cfg = qwen3_4b_config(2)
        points, G, check_size, p5, p6 = [(8192, 512), (4096, 256)], 8, (512, 64, 4), (20, 16384), (8192, 512, 8, 256)
        p10 = (8192, 512, 8, 1024, 16384) if args.p10_workload == "group" else (8192, 512, 1, 64, 16384)
    env = environment(device)
    log(f"gpu_check: {env.get('gpu') or env.get('cpu')}, torch {env['versions']['torch']}")
    exact = _exactness(check_cfg, device, *check_size, log)
    exact["stream_float32"] = _stream_exactness(check_cfg, device, log)
    hyb = _hybrid_exactness(device, log)
    invariance = _invariance(check_cfg, device, log)
    contenders = ["flexgroup", "flexgroup-lse"] + (["prefix-grouper"] if pg_available() else [])
    check = gpu_bench.check_correctness(check_cfg, device, contenders, *check_size, log)
    flash = _flash_parity(check_cfg, device, log)  # correctness of the FLASH backend, before any timing
    # --toy: the same CUDA branches on fake cuda tensors (shapes, dtypes, devices; no GPU needed)
    fake = (fake_cuda_trace.run(check_cfg, *check_size, lambda: gpu_bench.build(check_cfg, torch.float32, "cpu"), log)
            if args.toy else {"skipped": "a real CUDA run"})
    bad = ([k for k, v in exact.items() if not v["ok"]] + (["hybrid"] if hyb.get("ok") is False else [])
           + (["flash"] if flash.get("ok") is False else []) + (["fake_cuda"] if fake.get("ok") is False else []))
    if bad:
        log(f"exactness FAILED ({bad}): nothing is timed")
        return 1
    m = gpu_bench.build(cfg, dtype, device)
    model_points = [gpu_bench.model_point(m, cfg, P, R, G, contenders, args.repeats, 1, device, log)
                    for P, R in points]
    del m
    if device == "cuda":
        torch.cuda.empty_cache()
    refused = _flex_refused(cfg, device, dtype)
    if refused:  # CPU only: the compiled CPU kernel failed flexgroup's self-check on this torch build
        log(f"compiled flex refused here, P2 and P5 skipped: {refused}")
        attention_points, compiles = [], {"skipped": refused}
    else:
        attention_points = [gpu_bench.attention_point(cfg, P, R, G, dtype, device, args.repeats, 1, train)
                            for P, R in points[:1] for train in ([False, True] if device == "cuda" else [False])]
        compiles = _compiles(cfg, device, dtype, *p5, log)
    largest = _largest_group(cfg, device, *p6, log)
    streamed = _largest_streamed_group(cfg, device, *p10, log, workload=args.p10_workload)
    data = dict(env=env, toy=args.toy, dtype=str(dtype), repeats=args.repeats,
                model=f"Qwen3-4B shape, {cfg.num_hidden_layers} layers" if not args.toy else "toy Qwen3",
                exactness=exact, hybrid=hyb, invariance=invariance, check=check, model_points=model_points,
                attention_points=attention_points, compiles=compiles, flash=flash, fake_cuda=fake,
                largest_group=largest,
                streamed_group=streamed,
                wall_s=time.perf_counter() - t0)
    os.makedirs(args.out, exist_ok=True)
    tag = "toy-cpu" if args.toy else (env.get("gpu", "gpu").replace(" ", "_") + "-" + env["date"][:10])
    stem = os.path.join(args.out, f"gpu_check-{tag}")
    write_json(data, stem + ".json")
    with open(stem + ".md", "w") as f:
        f.write(to_markdown(data))
    log(f"wrote {stem}.md and .json ({data['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
