"""Hybrid decoders (Gated DeltaNet / Mamba2 mixers + full attention): grouped == each [P; R_i] alone.

Oracle: every root-to-leaf sequence run alone through a stock, unpatched deep copy of the model.
Tiny models come from ``flexgroup.models.zoo`` (hidden 64, 2 layers: a stateful mixer, then full
attention; NemotronH adds an MLP block after each; Falcon-H1 runs attention and its mixer side by
side in both layers). Conv kernel 4 everywhere; the GDN chunk is 64
(fixed by transformers), the tiny Mamba2 chunk 16, so the long rows below cross chunk boundaries
and the response starts fall inside chunks of the stock run.

Tolerances (``precision_for``): float64 runs under ``KeepFloat64``, which keeps the GDN / Mamba2
scans in float64 too (transformers runs them in float32 otherwise): measured <= 6e-15 on log-probs.
float32: the grouped run chunks the prompt and each response separately, the stock run chunks
``[P; R_i]`` as one sequence, so the scans round differently; measured <= 6e-6 on log-probs of these
tiny models (FIELD-NOTES reports up to 3e-4 on larger ones), inside the shared 1e-5 / 1e-4 bounds.
"""

from __future__ import annotations

import copy

import pytest
import torch

import flexgroup
from flexgroup import GroupedBatch, Layout
from flexgroup.models.zoo import build_model, unavailable
from flexgroup.kernels import fork
from flexgroup.patches import hybrid
from flexgroup.patches.hybrid import spec as hybrid_spec
from flexgroup.patches.hybrid import wrappers as hybrid_wrappers
from flexgroup.patches._common import find_language_model, unwrap

# every hybrid needs the transformers generation flexgroup's hybrid patches follow (feature-detected)
pytestmark = pytest.mark.skipif(bool(unavailable("qwen3_5_text")), reason=str(unavailable("qwen3_5_text")))

GDN_ARCHS = ["qwen3_5_text", "qwen3_next", "olmo_hybrid"]
MAMBA_ARCHS = ["bamba", "granitemoehybrid", "nemotron_h", "falcon_h1"]
ARCHS = GDN_ARCHS + MAMBA_ARCHS

# two groups in one row: a prompt crossing the 64-token GDN chunk with responses of 1-3 tokens (the conv
# window straddles the prompt boundary) and one longer than a chunk; a 2-token prompt (shorter than the
# conv window); then a G=1 group with a 1-token prompt
SIZES = [(67, [1, 2, 3, 70]), (2, [5, 1]), (1, [4])]


def _model(arch, dtype=torch.float64, **overrides):
    if why := unavailable(arch):  # below the transformers flexgroup declares for it (a refusal above it fails)
        pytest.skip(why)
    return build_model(arch, dtype=dtype, **overrides)


def _mixers(model):
    lm = find_language_model(unwrap(model), "model")
    return [m for _, _, m in hybrid.stateful_modules(lm)]


def _grouped_run(model, batch, advantages):
    lp = batch.logprobs(model(**batch.model_inputs()).logits)
    loss = sum(a * lp[i].sum() for i, a in enumerate(advantages))
    loss.backward()
    return lp


def _compare(model, stock, prompts, responses, dtype, oracle, precision_for, grads=True):
    ctx, atol, rel = precision_for(dtype)
    flexgroup.patch(model)
    batch = GroupedBatch.from_groups(prompts, responses)
    n = sum(len(r) for r in responses)
    adv = torch.linspace(-1.0, 1.5, n, dtype=dtype)
    with ctx:
        lp = _grouped_run(model, batch, adv)
        _, ref = oracle.run(stock, prompts, responses)
        oracle.loss(ref, adv).backward()
    err = max((lp[i, : len(r)] - r).abs().max().item() for i, r in enumerate(ref))
    assert err <= atol, f"log-prob error {err:.3g} > {atol}"
    if grads:
        oracle.assert_grads_close(oracle.grads(model), oracle.grads(stock), rel)
    return err


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_grouped_equals_each_sequence_alone(arch, dtype, groups, hf_oracle, precision_for):
    model = _model(arch, dtype)
    stock = hf_oracle.stock_copy(model)
    prompts, responses = groups(SIZES, seed=1, vocab=model.config.vocab_size)
    _compare(model, stock, prompts, responses, dtype, hf_oracle, precision_for)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "bamba"])
def test_three_level_tree(arch, hf_oracle, precision_for):
    """A 2-token middle segment (shorter than the conv window): its children's conv reads the root too."""
    ctx, atol, rel = precision_for(torch.float64)
    model = _model(arch)
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model)
    layout = Layout.tree(parents=[-1, 0, 1, 1, 0, 4, -1], lengths=[6, 2, 3, 1, 66, 2, 3])
    ids = torch.randint(1, model.config.vocab_size, (layout.num_tokens,), generator=torch.Generator().manual_seed(2))
    batch = GroupedBatch.from_layout(layout, ids)
    with ctx:
        lp = _grouped_run(model, batch, torch.ones(len(layout.leaves), dtype=torch.float64))
        loss = 0
        for i, path in enumerate(batch.paths):
            seq = ids[path]
            logits = stock(input_ids=seq[None], use_cache=False).logits[0]
            ref = torch.log_softmax(logits[:-1], -1).gather(1, seq[1:, None])[:, 0]
            err = (lp[i, 1: len(seq)] - ref).abs().max().item()
            assert err <= atol, f"path {i}: log-prob error {err:.3g}"
            loss = loss + ref.sum()
        loss.backward()
    hf_oracle.assert_grads_close(hf_oracle.grads(model), hf_oracle.grads(stock), rel)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "bamba"])
def test_training_checkpointing_lora(arch, groups, hf_oracle, precision_for):
    """Training mode, non-reentrant gradient checkpointing (the layout must survive recomputation) and
    LoRA on the stateful mixer's projections: LoRA gradients equal the stock model's. float32: checkpoint
    recomputation runs outside ``KeepFloat64`` (a TorchFunctionMode), so float64 would recompute in float32."""
    peft = pytest.importorskip("peft")
    targets = {"qwen3_5_text": ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj"], "bamba": ["in_proj", "out_proj"]}
    base = _model(arch, torch.float32)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets[arch], init_lora_weights=False)
    model = peft.get_peft_model(base, cfg)
    stock = hf_oracle.stock_copy(model)
    for m in (model, stock):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompts, responses = groups([(67, [2, 3]), (2, [1])], seed=3, vocab=base.config.vocab_size)
    _compare(model, stock, prompts, responses, torch.float32, hf_oracle, precision_for)
    assert any("lora" in n for n in hf_oracle.grads(model)), "LoRA parameters got no gradient"


@pytest.mark.parametrize("arch", ["qwen3_5_text", "nemotron_h"])
def test_mask_only_packed_row_is_wrong(arch, groups, hf_oracle, precision_for, monkeypatch):
    """Why forking is needed: the right attention mask and positions, but stock mixers run over the
    packed row (state flows from P into R1, from R1 into R2, ...). The model-level guard refuses such a
    forward; with the guard defeated too, responses after the first differ."""
    model = _model(arch)
    stock = hf_oracle.stock_copy(model)
    prompts, responses = groups([(8, [3, 3, 3])], seed=4, vocab=model.config.vocab_size)
    flexgroup.patch(model)
    for m in _mixers(model):  # the stock forward, with no layout: one sequence through the whole row
        monkeypatch.setattr(m, "forward", lambda *a, m=m, **kw: type(m).forward(m, *a, **{**kw, "attention_mask": None}))
    batch = GroupedBatch.from_groups(prompts, responses)
    with torch.no_grad(), pytest.raises(RuntimeError, match="did not take flexgroup's grouped path"):
        model(**batch.model_inputs())

    def leaking(*a, m, **kw):  # also report the grouped path to the guard, as a broken mixer patch would
        hybrid_spec._RAN.get().add(id(m))
        return type(m).forward(m, *a, **{**kw, "attention_mask": None})

    for m in _mixers(model):
        monkeypatch.setattr(m, "forward", lambda *a, m=m, **kw: leaking(*a, m=m, **kw))
    ctx, atol, _ = precision_for(torch.float64)
    with torch.no_grad(), ctx:
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        _, ref = hf_oracle.run(stock, prompts, responses)
    errs = [(lp[i, :3] - r).abs().max().item() for i, r in enumerate(ref)]
    assert errs[0] <= atol  # R1 follows P in the row: its state is right
    assert min(errs[1:]) > 1e-2, f"mask-only packing was not detected: {errs}"


@pytest.mark.parametrize("arch", ["qwen3_next", "granitemoehybrid"])
def test_moe_router_aux_loss_equals_the_padded_baseline(arch, groups, hf_oracle):
    """MoE hybrids route per token; the load-balancing loss counts each token once per sequence through it."""
    model = _model(arch)
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model)
    prompts, responses = groups([(6, [3, 1, 4])], seed=6, vocab=model.config.vocab_size)
    batch = GroupedBatch.from_groups(prompts, responses)
    seqs = [torch.cat([prompts[0], r]) for r in responses[0]]
    n = max(len(x) for x in seqs)
    ids = torch.stack([torch.cat([x, x.new_zeros(n - len(x))]) for x in seqs])
    mask = (torch.arange(n)[None] < torch.tensor([len(x) for x in seqs])[:, None]).long()
    with torch.no_grad():
        got = model(**batch.model_inputs(), output_router_logits=True).aux_loss
        want = stock(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())  # the routers run in float32


def test_registered_hybrid_with_an_unknown_stateful_module_is_refused():
    model = _model("qwen3_5_text")
    model.model.layers[1].mlp.short_conv = torch.nn.Conv1d(4, 4, 3, groups=4, padding=2)  # a causal depthwise conv
    with pytest.raises(ValueError, match="layer 1 holds Qwen3_5MLP, a stateful token mixer"):
        flexgroup.patch(model)
    assert not flexgroup.patches.is_patched(model)


def test_generic_self_check_row_exposes_stateful_mixers():
    """The generic path's check row: a prompt past a 64-token chunk (and past a small window), 1- and 2-token
    responses, two groups and a 3-level tree with a 1-token middle segment."""
    from types import SimpleNamespace

    from flexgroup.patches.generic import check_layout

    lay = check_layout(SimpleNamespace(sliding_window=100, max_position_embeddings=4096))
    depth = [len(a) for a in lay.ancestors]
    assert lay.lengths[0] == 102 and len(lay.roots) == 3 and max(depth) == 2
    assert {1, 2} <= {lay.lengths[s] for s in range(lay.num_segments) if depth[s] > 0}
    assert any(lay.lengths[s] == 1 and lay.children[s] for s in range(lay.num_segments))
    assert check_layout(SimpleNamespace(max_position_embeddings=4096)).lengths[0] == 70  # crosses 64
    assert check_layout(SimpleNamespace(max_position_embeddings=40)).max_position < 40


def test_fork_plan_conv_window_spans_ancestors():
    # root 5 tokens [0..4], child 1 token [5], grandchild 2 tokens [6, 7]; kernel 4 -> 3 context inputs
    layout = Layout.tree(parents=[-1, 0, 1], lengths=[5, 1, 2])
    plan = fork.fork_plan(layout, 4)
    L = layout.num_tokens
    assert plan.levels[0].conv_index.tolist() == [[L, L, L, 0, 1, 2, 3, 4]]
    assert plan.levels[1].conv_index.tolist() == [[2, 3, 4, 5]]
    assert plan.levels[2].conv_index.tolist() == [[3, 4, 5, 6, 7]]  # context: 2 root tokens + the child
    assert plan.levels[2].parent_rows.tolist() == [0]
    # splitting by depth and reassembling is the identity on the packed row
    x = torch.arange(L, dtype=torch.float64)[None, :, None]
    parts = [fork.padded(x)[lv.token_index] for lv in plan.levels]
    assert torch.equal(fork.pack_back(parts, plan), x)


def test_fork_plan_splits_a_depth_into_well_filled_calls():
    # responses 70, 3, 2, 1: one padded call would be 76 real tokens of 280; calls [70], [3, 2], [1]
    layout = Layout.group(5, [3, 70, 1, 2])
    plan = fork.fork_plan(layout, 4)
    rows = [(lv.depth, lv.token_index.shape) for lv in plan.levels]
    assert rows == [(0, (1, 5)), (1, (1, 70)), (1, (2, 3)), (1, (1, 1))]
    assert all(lv.parent_rows.tolist() == [0] * len(lv.parent_rows) for lv in plan.levels[1:])
    x = torch.arange(layout.num_tokens, dtype=torch.float64)[None, :, None]
    assert torch.equal(fork.pack_back([fork.padded(x)[lv.token_index] for lv in plan.levels], plan), x)


def test_the_fork_plan_is_built_once_per_forward_and_kept_in_the_carrier():
    model = flexgroup.patch(_model("qwen3_5_text"))
    batch = GroupedBatch.from_groups([torch.tensor([1, 2, 3])], [[torch.tensor([4]), torch.tensor([5, 6])]])
    inputs = batch.model_inputs()
    calls = []
    real = fork.fork_plan
    try:
        hybrid_wrappers.fork_plan = lambda *a: calls.append(a) or real(*a)
        with torch.no_grad():
            model(**inputs)
            n_first = len(calls)
            model(**inputs)  # a new forward plans anew (no process-wide cache serves it)
    finally:
        hybrid_wrappers.fork_plan = real
    kernels = {k[1] for k in calls}
    assert n_first == len(kernels) >= 1  # one plan per conv width per forward, shared by every mixer layer
    assert len(calls) == 2 * n_first
    assert any(k[0] == "fork" for k in inputs["attention_mask"]._plans)
    assert not hasattr(fork.fork_plan, "cache_info")


def test_patched_model_on_plain_inputs_and_unpatch(hf_oracle):
    model = _model("qwen3_5_text")
    stock = hf_oracle.stock_copy(model)
    x = torch.randint(1, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    flexgroup.patch(model)
    assert flexgroup.patches.is_patched(model)
    twin = copy.deepcopy(model)  # a copy's mixers must fork with their own weights
    assert all(m.forward.__self__ is m for m in _mixers(twin))
    with torch.no_grad():
        ref = stock(input_ids=x, use_cache=False).logits
        assert torch.allclose(model(input_ids=x, use_cache=False).logits, ref, atol=1e-12, rtol=0)
        flexgroup.unpatch(model)
        assert not flexgroup.patches.is_patched(model)
        assert all("forward" not in m.__dict__ for m in _mixers(model))
        assert torch.allclose(model(input_ids=x, use_cache=False).logits, ref, atol=1e-12, rtol=0)


def test_grouped_inputs_with_a_cache_are_refused():
    model = flexgroup.patch(_model("bamba"))
    batch = GroupedBatch.from_groups([torch.tensor([1, 2, 3])], [[torch.tensor([4]), torch.tensor([5, 6])]])
    with pytest.raises(ValueError, match="use_cache"):
        model(**{**batch.model_inputs(), "use_cache": True})
    mixer = _mixers(model)[0]
    hidden = torch.zeros(1, batch.num_tokens, model.config.hidden_size, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="state cache"):
        mixer(hidden, cache=object(), attention_mask=batch.model_inputs()["attention_mask"])


def test_unpatched_hybrid_refuses_grouped_inputs():
    model = _model("qwen3_5_text")
    batch = GroupedBatch.from_groups([torch.tensor([1, 2, 3])], [[torch.tensor([4]), torch.tensor([5, 6])]])
    with pytest.raises(RuntimeError, match="flexgroup.patch"):
        model(**batch.model_inputs())


def _qwen3_5_vl(dtype):
    """A tiny Qwen3_5ForConditionalGeneration (GDN + full-attention decoder, 2-block vision tower), sdpa."""
    import transformers

    from test_vl import IMG, V, VE, VID, VS

    text = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True, "partial_rotary_factor": 1.0})
    vision = dict(patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_heads=2, depth=2,
                  hidden_size=16, intermediate_size=24, out_hidden_size=32, num_position_embeddings=16)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMG,
                                        video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.Qwen3_5ForConditionalGeneration(config).to(dtype).eval()


# float32 only: the GDN decay's parameters (A_log, dt_bias, in_proj_a) collect one term per token and head, with
# cancellation, so the different chunking of [P; R_i] vs P and R_i shows at ~2e-3 relative (float64: 7e-12);
# every other tensor 1e-4
_DECAY_REL = 5e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", ["two_groups", "video"])
def test_qwen3_5_vision_language(name, dtype, hf_oracle, precision_for):
    """M-RoPE from the model's own rope index (MultimodalGroupedBatch), the vision tower once per prompt,
    GDN state forked in the decoder: log-probs and every gradient (decoder and vision tower)."""
    from test_vl import _baseline, case

    from flexgroup.data.multimodal import MultimodalGroupedBatch

    ctx, atol, rel = precision_for(dtype)
    model = _qwen3_5_vl(dtype)
    stock = hf_oracle.stock_copy(model)
    flexgroup.patch(model)
    vision_impl = model.model.visual.config._attn_implementation
    prompts, responses, vision = case(name, "qwen3_vl")
    batch = MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)
    adv = torch.linspace(-1.0, 1.5, batch.num_responses, dtype=dtype)
    with ctx:
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        (lp * adv[:, None]).sum().backward()
        _, ref = _baseline(stock, prompts, responses, vision)
        hf_oracle.loss(ref, adv.tolist()).backward()
    assert max((lp[i, : len(r)] - r).abs().max().item() for i, r in enumerate(ref)) <= atol
    got, want = hf_oracle.grads(model), hf_oracle.grads(stock)
    assert any(n.startswith("model.visual.") for n in want)
    decay = [n for n in want if n.endswith(("A_log", "dt_bias", "in_proj_a.weight"))]
    hf_oracle.assert_grads_close({n: got[n] for n in decay}, {n: want[n] for n in decay},
                                 rel if dtype == torch.float64 else _DECAY_REL)
    hf_oracle.assert_grads_close({n: g for n, g in got.items() if n not in decay},
                                 {n: g for n, g in want.items() if n not in decay}, rel)
    assert model.model.visual.config._attn_implementation == vision_impl  # the tower keeps its attention
    flexgroup.unpatch(model)
    assert model.model.language_model.config._attn_implementation == "sdpa"


# stateful mixers flexgroup does not fork: (config overrides, the class the error must name)
UNHANDLED = {
    "lfm2": (dict(layer_types=["conv", "full_attention"]), "Lfm2ShortConv"),
    "lfm2_moe": (dict(layer_types=["conv", "full_attention"], num_dense_layers=2), "Lfm2MoeShortConv"),
    "minimax": (dict(layer_types=["linear_attention", "full_attention"]), "MiniMaxLightningAttention"),
    "jamba": (dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                   num_experts=2), "JambaMambaMixer"),
    "recurrent_gemma": (dict(), "RecurrentGemmaRecurrentBlock"),
    # its full attention is KimiLinearAttention: the model-type prefix is not read as "linear attention"
    "kimi_linear": (dict(), "holds KimiLinearDeltaAttention:"),
}


@pytest.mark.parametrize("arch", sorted(UNHANDLED))
def test_unhandled_stateful_mixers_are_refused_at_patch(arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    if why := unavailable(arch):
        pytest.skip(why)
    overrides, cls = UNHANDLED[arch]
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, **overrides)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kw))
    with pytest.raises(ValueError, match=cls):
        flexgroup.patch(model)
    assert not flexgroup.patches.is_patched(model)
