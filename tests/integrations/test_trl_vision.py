"""TRL GRPOTrainer on Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 with images: flexgroup vs stock TRL, same seeds and
replayed completions (issue 41, items 1 and 4).

Both trainers load the same tiny checkpoint (:mod:`_trl_vision`), see the same conversational prompts with one
image each (two prompts show the same pixels) and score the same completions (``generate`` replaced by a
deterministic function of the prompt, as in test_trl.py). Old-policy log-probs (``num_iterations=2``) and the
reference model (``beta > 0``) are on, so all three roles run; two optimizer steps. Compared per step: the loss,
the KL metric and every parameter gradient (decoder, vision tower, merger); after the 2 steps every weight.
The stock run is the oracle: TRL's own forward, each row with its own copy of the images, through the
unpatched model. Broken variant: M-RoPE ids replaced by 1-D positions in the grouped batch -- caught.
Qwen3.5 (Gated DeltaNet + full attention, loaded from disk: transformers 5.25 re-kernelizes it on TRL's
``train()``) runs the same comparisons; its GDN decay parameters get their own float32 tolerance
(``_DECAY_REL``), and a float64 run with the scan kept in float64 shows them as close as every other tensor.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from _trl_vision import PatchProcessor, save_tiny_vl, vl_dataset, vl_reward, vl_tokenizer  # noqa: E402
from test_trl import _fix_generations  # noqa: E402

from flexgroup.data import multimodal  # noqa: E402
from flexgroup.integrations.trl import FlexGroupGRPOTrainer  # noqa: E402

G = 3
KINDS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"]
# Qwen3.5's GDN decay parameters (A_log, dt_bias, in_proj_a): their gradients sum one term per token and head with
# cancellation (~1e-7 against ~1e-1 elsewhere), and the torch scan computes in float32 whatever the model's dtype,
# chunked differently over [prompt; completion] than over the packed row: measured 4.9e-3 relative to the
# gradient's largest entry, compared without an absolute floor. In float64 with the scan kept in float64 they
# agree to 2.6e-6 like every other tensor (test_qwen3_5_float64_every_gradient).
_DECAY = ("A_log", "dt_bias", "in_proj_a.weight")
_DECAY_REL = 1e-2


class Steps:
    """Trainer mixin: per step the loss, the KL metric and a copy of every parameter gradient."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.losses = getattr(self, "losses", []) + [loss.detach().clone()]
        self.kls = getattr(self, "kls", []) + [self._metrics["train"]["kl"][-1]]
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not hasattr(self, "w0"):
            self.w0 = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        out = super().training_step(model, inputs, num_items_in_batch)
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.grads = getattr(self, "grads", []) + [grads]
        return out


class Stock(Steps, trl.GRPOTrainer):
    pass


class Grouped(Steps, FlexGroupGRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, flexgroup_backend="sdpa", **kwargs)


@pytest.fixture(scope="module", params=KINDS)
def vl_dir(request, tmp_path_factory):
    return request.param, save_tiny_vl(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory):
    return save_tiny_vl(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl")


def _config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=2 * G, num_generations=G,
                max_completion_length=8, steps_per_generation=1, gradient_accumulation_steps=1,
                # plain SGD: Adam turns float32 noise on near-zero gradient entries into lr-sized steps, which
                # would hide the weights' agreement behind its own noise
                num_iterations=2, beta=0.1, max_steps=2, learning_rate=0.5, optim="sgd", logging_steps=1,
                report_to="none", save_strategy="no", use_cpu=True, seed=0, bf16=False, fp16=False,
                max_grad_norm=1.0, disable_dropout=True, temperature=0.7,
                model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"})
    base.update(kw)
    return trl.GRPOConfig(**base)


def run(cls, path, tmp_path, n_prompts: int = 4, words: int = 6, **kw):
    trainer = cls(model=path, reward_funcs=vl_reward, args=_config(tmp_path, **kw),
                  train_dataset=vl_dataset(n_prompts, words=words), processing_class=PatchProcessor(vl_tokenizer()))
    _fix_generations(trainer)
    trainer.train()
    return trainer


def assert_same_steps(a, b, what: str):
    assert len(a.losses) == len(b.losses) == 2, what
    for step, (la, lb, ka, kb) in enumerate(zip(a.losses, b.losses, a.kls, b.kls)):
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6, msg=f"{what}: loss of step {step}")
        assert abs(ka - kb) <= 1e-5 * abs(kb) + 1e-7, f"{what}: KL of step {step}: {ka} vs {kb}"
    for step, (ga, gb) in enumerate(zip(a.grads, b.grads)):
        assert ga.keys() == gb.keys(), what
        # the tower's gradients are compared too (Qwen3-VL's second deepstack merger norm gets 0 in stock TRL)
        assert sum(g.abs().max().item() > 0 for n, g in gb.items() if "visual" in n) >= 8, what
        for name, g in gb.items():
            scale, err = g.abs().max().item(), (ga[name] - g).abs().max().item()
            tol = _DECAY_REL * scale if name.endswith(_DECAY) else 1e-4 * scale + 1e-8   # Qwen3.5: see _DECAY_REL
            assert err <= tol, f"{what} step {step}: {name}: |grad diff| {err:.3g}, scale {scale:.3g}"
    wa, wb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    for name, w in wb.items():   # the weights after 2 steps, against the size of the stock update
        assert torch.equal(a.w0[name], b.w0[name]), name
        moved, err = (w - b.w0[name]).abs().max().item(), (wa[name] - w).abs().max().item()
        ulp = torch.finfo(w.dtype).eps * w.abs().max().item()     # the weight's own float32 rounding
        assert err <= 1e-4 * moved + 2 * ulp, f"{what}: weight {name} after 2 steps: |diff| {err:.3g}, update {moved:.3g}"


def test_vl_grpo_steps_equal_stock_trl(vl_dir, tmp_path):
    kind, path = vl_dir
    stock = run(Stock, path, tmp_path / "stock")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flexgroup: stock")   # never the stock fallback here
        grouped = run(Grouped, path, tmp_path / "grouped")
    assert_same_steps(grouped, stock, kind)
    s = grouped.flexgroup_stats
    assert {"policy", "old", "ref"} <= set(s), dict(s)
    for role in ("policy", "old", "ref"):
        assert s[role]["fallback_tokens"] == 0
        assert s[role]["grouped_tokens"] < s[role]["real_tokens"]
        # each prompt's image once per packed row instead of once per completion (G of them)
        assert G * s[role]["vision_patches"] <= s[role]["baseline_patches"], dict(s[role])


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    return save_tiny_vl(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")


class Budget(Grouped):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, flexgroup_budget=128, **kwargs)


@pytest.mark.parametrize("grouped_cls", [Grouped, Budget], ids=["whole", "budget"])
def test_qwen3_5_float64_every_gradient(grouped_cls, qwen35_dir, tmp_path, precision_for, monkeypatch):
    """Qwen3.5 in float64 with HF's float32 casts (the GDN scan's too) kept in float64: every gradient, the decay
    parameters' included, within 2e-5 of the largest entry (measured 3.9e-6: TRL's loss is float32). With the
    budget (60-word prompts: every chunk streamed) the mode also covers the policy's streamed backward, which
    runs inside TRL's backward, where a TorchFunctionMode entered around ``train()`` is not active."""
    from flexgroup.integrations import trl_stream

    ctx, _, _ = precision_for(torch.float64)
    backward = trl_stream._StreamedLogprobs.backward

    def backward_in_float64(bctx, *grads):
        with precision_for(torch.float64)[0]:
            return backward(bctx, *grads)

    monkeypatch.setattr(trl_stream._StreamedLogprobs, "backward", staticmethod(backward_in_float64))
    kw = dict(model_init_kwargs={"dtype": torch.float64, "attn_implementation": "sdpa"}, words=6 if grouped_cls is
              Grouped else 60, gradient_checkpointing=False)   # recomputation would run outside the float64 mode
    with ctx:
        stock = run(Stock, qwen35_dir, tmp_path / "stock", **kw)
        grouped = run(grouped_cls, qwen35_dir, tmp_path / "grouped", **kw)
    assert any(n.endswith(_DECAY) for n in stock.grads[0])
    if grouped_cls is Budget:
        assert grouped.flexgroup_stats["policy"]["streamed_forwards"] > 0, dict(grouped.flexgroup_stats["policy"])
    for step, (ga, gb) in enumerate(zip(grouped.grads, stock.grads)):
        for name, g in gb.items():
            scale, err = g.abs().max().item(), (ga[name] - g).abs().max().item()
            assert g.dtype == torch.float64 and err <= 2e-5 * scale, f"step {step}: {name}: {err:.3g} of {scale:.3g}"


def test_broken_mrope_is_caught(tmp_path, monkeypatch, qwen25_dir):
    path = qwen25_dir
    stock = run(Stock, path, tmp_path / "stock")

    real = multimodal.MultimodalGroupedBatch.model_inputs

    def flat_positions(self, *args, **kwargs):   # 1-D virtual positions on all three M-RoPE rows
        out = real(self, *args, **kwargs)
        out["position_ids"] = out["position_ids"].clone()
        out["position_ids"][:] = self.position_ids.to(out["position_ids"].device)
        return out

    monkeypatch.setattr(multimodal.MultimodalGroupedBatch, "model_inputs", flat_positions)
    broken = run(Grouped, path, tmp_path / "broken")
    with pytest.raises(AssertionError):
        assert_same_steps(broken, stock, "broken")


def test_broken_gdn_state_fork_is_caught(tmp_path, monkeypatch, qwen35_dir):
    """Qwen3.5 with each completion's Gated DeltaNet scan started from zeros instead of its prompt's final
    state (the conv context still forked): the comparison fails."""
    from flexgroup.kernels import fork

    stock = run(Stock, qwen35_dir, tmp_path / "stock")
    monkeypatch.setattr(fork.ForkStates, "initial", lambda self, level: None)
    broken = run(Grouped, qwen35_dir, tmp_path / "broken")
    with pytest.raises(AssertionError):
        assert_same_steps(broken, stock, "broken")


# ------------------------------------------------------------------ 2 processes (gloo, DDP)
@pytest.fixture(scope="module")
def vl_runs(tmp_path_factory):
    import torch.distributed as dist

    from test_trl_distributed import HARNESS, _spawn

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("trl_vl_dist")
    save_tiny_vl(out / "model", "qwen2_5_vl")   # the harness loads OUTDIR/model
    return _spawn(out, ["vl_stock", "vl_flex", "vl_budget_stock", "vl_budget"],
                  harness=HARNESS.with_name("_trl_vision_dist.py"))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["vl_flex", "vl_budget"])
def test_vl_grpo_under_ddp_equals_stock_trl_per_step(vl_runs, case):
    """Per rank and step: loss, KL, every gradient (the tower's too) after DDP's all-reduce -- or, with the
    budget, the adapter's own average --, the weights after 2 steps; the ranks' gradients equal."""
    from test_trl_distributed import _check

    _check(vl_runs, case, "vl_stock" if case == "vl_flex" else "vl_budget_stock")
    for r in range(2):
        s = vl_runs[case][r]["stats"]
        assert not any("stock TRL forward" in w for w in vl_runs[case][r]["warnings"])
        assert G * s["policy"]["vision_patches"] <= s["policy"]["baseline_patches"]
        assert any("visual" in n for n in vl_runs[case][r]["steps"][0]["grads"])
        if case == "vl_budget":
            assert s["policy"]["streamed_forwards"] > 0 and s["ref"]["streamed_forwards"] > 0, s


def _method_inputs(proc, n_prompts: int = 2, G_: int = 2, width: int = 4):
    """TRL's arguments for ``_get_per_token_logps_and_entropies``: rows [prompt; completion], the prompts'
    images row after row (each row its own copy), num_images, mm_token_type_ids."""
    ds = vl_dataset(n_prompts)
    rows = [r for r in ds for _ in range(G_)]
    texts = [proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r[
        "prompt"][0]["content"]}]}]) for r in rows]
    enc = proc(text=texts, images=[[r["image"]] for r in rows], padding=True, return_tensors="pt")
    g = torch.Generator().manual_seed(3)
    comp = torch.randint(3, 29, (len(texts), width), generator=g)
    cm = (torch.arange(width)[None] < torch.randint(1, width + 1, (len(texts), 1), generator=g)).long()
    ids, am = torch.cat([enc["input_ids"], comp * cm], 1), torch.cat([enc["attention_mask"], cm], 1)
    kw = dict(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"], num_images=[1] * len(texts),
              mm_token_type_ids=torch.cat([enc["mm_token_type_ids"], torch.zeros_like(comp)], 1))
    return ids, am, width, kw


def test_inputs_that_disagree_with_the_placeholders_take_the_stock_path_bit_identical(qwen25_dir, tmp_path):
    """mm_token_type_ids that do not mark the image placeholders (the stock forward reads them as given): one
    warning naming the cause, then TRL's own method -- the same bits as the stock trainer."""
    from flexgroup.integrations.trl import patch_trainer

    trainer = trl.GRPOTrainer(model=qwen25_dir, reward_funcs=vl_reward, args=_config(tmp_path),
                              train_dataset=vl_dataset(2), processing_class=PatchProcessor(vl_tokenizer()))
    takes = inspect.signature(trainer._get_per_token_logps_and_entropies).parameters
    if "mm_token_type_ids" not in takes:
        pytest.skip(f"TRL {trl.__version__}'s log-prob method takes no mm_token_type_ids (nothing to disagree)")
    ids, am, k, kw = _method_inputs(trainer.processing_class)
    kw["mm_token_type_ids"] = torch.zeros_like(kw["mm_token_type_ids"])

    def logps():
        with torch.no_grad():
            return trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, am, k, batch_size=4, **kw)[0]

    stock = logps()
    patch_trainer(trainer, backend="sdpa")
    with pytest.warns(UserWarning, match="stock TRL forward.*mm_token_type_ids of row 0"):
        got = logps()
    assert torch.equal(got, stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # said once
        logps()
    assert trainer.flexgroup_stats["ref"]["fallback_tokens"] == 2 * ids.numel()


def test_images_in_another_order_than_their_placeholders_take_the_stock_path(qwen25_dir, tmp_path):
    """Rows with two images (2 and 4 placeholders) whose items TRL's tensors list as [4, 2]: the totals and
    num_images agree and the stock forward runs silently; flexgroup names the disagreement once and runs
    TRL's own method (before: grouped silently, on the items as given)."""
    from _trl_vision import image
    from flexgroup.integrations.trl import patch_trainer

    trainer = trl.GRPOTrainer(model=qwen25_dir, reward_funcs=vl_reward, args=_config(tmp_path),
                              train_dataset=vl_dataset(2), processing_class=PatchProcessor(vl_tokenizer()))
    proc, g = trainer.processing_class, torch.Generator().manual_seed(5)
    small, big = image(2, 4, g), image(4, 4, g)
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}] * 2 + [{"type": "text",
                                                                                             "text": "a b"}]}])
    enc = proc(text=[text] * 2, images=[[small, big]] * 2, padding=True, return_tensors="pt")
    comp = torch.tensor([[5, 6, 7], [5, 8, 9]])
    ids, am = torch.cat([enc["input_ids"], comp], 1), torch.cat([enc["attention_mask"], torch.ones_like(comp)], 1)
    pv, gt = enc["pixel_values"], enc["image_grid_thw"]      # per row: small (8 patch rows), big (16)
    order = [1, 0, 3, 2]
    cuts = [0, 8, 24, 32, 48]
    kw = dict(pixel_values=torch.cat([pv[cuts[i]:cuts[i + 1]] for i in order]), image_grid_thw=gt[order],
              num_images=[2, 2], mm_token_type_ids=torch.cat([enc["mm_token_type_ids"], torch.zeros_like(comp)], 1))
    takes = inspect.signature(trainer._get_per_token_logps_and_entropies).parameters
    kw = {k: v for k, v in kw.items() if k in takes}   # TRL 0.20 takes neither num_images nor mm_token_type_ids

    def logps():
        with torch.no_grad():
            return trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, am, 3, **kw)[0]

    warned = pytest.warns(UserWarning, match=r"stock TRL forward.*row 0: its runs of placeholder tokens .* \[2, 4\]")
    try:
        stock = logps()
    except ValueError:  # transformers 4.56's Qwen2.5-VL refuses the mismatch itself: loud both ways
        patch_trainer(trainer, backend="sdpa")
        with warned, pytest.raises(ValueError, match="do not match"):
            logps()
        return
    patch_trainer(trainer, backend="sdpa")
    with warned:
        got = logps()
    assert torch.equal(got, stock)
