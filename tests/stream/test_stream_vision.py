"""Streaming x vision-language (issue 32, item 2): ``stream_backward`` / ``stream_logprobs`` with ``vision=``.

Oracle (independent of flexgroup): a deep copy of the stock, unpatched Qwen2-VL / Qwen2.5-VL / Qwen3-VL taken
before patching, given each sequence alone with that sequence's own images and videos (it computes its M-RoPE
ids and runs its tower itself). Compared: every log-prob and every parameter gradient -- decoder AND vision
tower (Qwen3-VL: deepstack mergers too) -- of ``sum_i adv_i * sum_t lp_i[t]``, float64 (``KeepFloat64``) and
float32, at budgets of 128 (chunks cut inside images), 200 and 1,024 tokens.

The tree (:func:`vl_tree`): a multi-turn trajectory with an image per turn, turn 2 branching mid-response, a
sibling whose turn-2 image has the same placeholder ids but other pixels (must not be shared), a third turn
showing turn 1's image again (encoded once), a separate tree with a video and a text-only sequence.
Broken variants (each a monkeypatched flexgroup, each must fail the same comparison): 1-D positions instead of
M-RoPE; the tower's gradient dropped; the features of the wrong image; Qwen3-VL's deepstack features dropped.
"""

from __future__ import annotations

import copy

import pytest
import torch

import flexgroup
from flexgroup.stream import vision as stream_vision
from flexgroup.stream.plan import plan_stream
from flexgroup.stream.vision import StreamVision

from test_vl import Prompt, _stock_inputs, make_vl

MODELS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
BUDGETS = (128, 200, 1024)
F64, F32 = torch.float64, torch.float32


def _cat(*vs):
    out: dict = {}
    for v in vs:
        for k, x in (v or {}).items():
            out.setdefault(k, []).append(x)
    return {k: torch.cat(x) for k, x in out.items()} or None


def vl_tree(kind: str, seed: int = 0):
    """-> sequences, vision (one entry per sequence), loss masks (the responses), advantages [N] (float64)."""
    g = torch.Generator().manual_seed(seed)
    txt = lambda n: torch.randint(3, 100, (n,), generator=g)  # noqa: E731
    t1, v1 = Prompt(kind, g).text(12).image(8, 8).text(6).build()       # turn 1: 16 image tokens
    t2, v2 = Prompt(kind, g).text(4).image(8, 12).text(4).build()       # turn 2: 24 image tokens
    other = Prompt(kind, g)                                             # turn 2 with other pixels, same ids
    other.ids = t2.tolist()
    other.vision = {k: [torch.randn(x.shape, generator=g, dtype=x.dtype) if x.is_floating_point() else x]
                    for k, x in v2.items()}
    t2c, v2c = other.build()
    t3 = torch.cat([txt(3), t1[12:12 + 18], txt(2)])                     # turn 3 shows turn 1's image again
    r1, r2, r3 = txt(24), txt(30), txt(20)
    parts = [  # (segments: (ids, vision, is response))
        [(t1, v1, 0), (r1, None, 1), (t2, v2, 0), (r2, None, 1)],
        [(t1, v1, 0), (r1, None, 1), (t2, v2, 0), (torch.cat([r2[:12], txt(20)]), None, 1)],   # mid-turn branch
        [(t1, v1, 0), (r1, None, 1), (t2c, v2c, 0), (r2, None, 1)],
        [(t1, v1, 0), (r1, None, 1), (t2, v2, 0), (r2, None, 1), (t3, v1, 0), (r3, None, 1)],
    ]
    vid, vv = Prompt(kind, g).text(5).video(2, 4, 8).text(3).build()
    parts.append([(vid, vv, 0), (txt(25), None, 1)])
    parts.append([(txt(30), None, 0), (txt(12), None, 1)])             # text only
    seqs, vision, masks = [], [], []
    for segs in parts:
        seqs.append(torch.cat([s for s, _, _ in segs]))
        vision.append(_cat(*[v for _, v, _ in segs]))
        masks.append(torch.cat([torch.full((len(s),), bool(r)) for s, _, r in segs]))
    adv = torch.linspace(-1.0, 1.5, len(seqs), dtype=F64)
    return seqs, vision, masks, adv


def alone(stock, seqs, vision, masks, adv, dtype, temperature: float = 1.0):
    """Each sequence alone through the stock model: lp [N, T] (0 off the mask); backward of sum adv_i lp_i."""
    T = max(len(s) for s in seqs)
    out = torch.zeros(len(seqs), T, dtype=dtype)
    for i, (s, v, m) in enumerate(zip(seqs, vision, masks)):
        logits = stock(**_stock_inputs(stock, s[:0], s, v)).logits[0]
        lp = torch.log_softmax(logits[:-1] / temperature, -1).gather(1, s[1:, None])[:, 0] * m[1:]
        (adv[i].to(dtype) * lp.sum()).backward()
        out[i, 1:len(s)] = lp.detach()
    return out


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(lp, got: dict, ref_lp, want: dict, dtype) -> tuple[float, float]:
    """AssertionError unless log-probs and every gradient agree; returns (log-prob error, worst relative grad error)."""
    atol, rel = (1e-10, 1e-8) if dtype == F64 else (1e-5, 1e-4)
    err = (lp.double() - ref_lp.double()).abs().max().item()
    assert err <= atol, f"log-prob error {err:.3g} > {atol}"
    assert got.keys() == want.keys(), f"gradient sets differ: {sorted(got.keys() ^ want.keys())[:6]}"
    worst = 0.0
    for n, w in want.items():
        e = (got[n] - w).abs().max().item() / max(w.abs().max().item(), 1e-30)
        assert e <= rel, f"{n}: grad error {e:.3g} relative"
        worst = max(worst, e)
    return err, worst


_ORACLE: dict = {}


def setup(kind, dtype, precision_for):
    """(patched model, tree, oracle lp, oracle grads, precision context); the oracle is computed once per case."""
    ctx = precision_for(dtype)[0]
    model = make_vl(kind, dtype)
    stock = copy.deepcopy(model)
    flexgroup.patch(model, backend="sdpa")
    tree = vl_tree(kind)
    if (kind, dtype) not in _ORACLE:
        with ctx:
            ref = alone(stock, *tree, dtype)
        _ORACLE[(kind, dtype)] = (ref, grads(stock))
    return (model, tree, *_ORACLE[(kind, dtype)], ctx)


def streamed(model, tree, budget, ctx, **kw):
    seqs, vision, masks, adv = tree
    model.zero_grad(set_to_none=True)
    with ctx:
        res = flexgroup.stream_backward(model, seqs, lambda lp, i: (lp * adv[i, None].to(lp.dtype)).sum(),
                                        loss_masks=masks, budget=budget, vision=vision, **kw)
    return res, grads(model)


def split_items(model, tree, budget) -> int:
    """How many visual items of the tree the schedule under ``budget`` cuts across chunks."""
    seqs, vision, masks, _ = tree
    sv = StreamVision(model, seqs, vision)
    plan = plan_stream(seqs, masks, budget, keys=sv.keys, pack_rows=False)
    sv.bind(plan.trie)
    chunk_of = torch.full((plan.trie.num_tokens,), -1)
    for c, ch in enumerate(plan.chunks):
        chunk_of[ch.tokens] = c
    rows = sv.rows
    return sum(len(set(chunk_of[(rows >= a) & (rows < b)].tolist())) > 1
               for a, b in zip(sv.offsets[:-1], sv.offsets[1:]))


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind", MODELS)
def test_streamed_vl_tree_equals_each_sequence_alone(kind, dtype, precision_for):
    model, tree, ref, want, ctx = setup(kind, dtype, precision_for)
    assert any(n.startswith("model.visual.") for n in want)
    if kind == "qwen3_vl":
        assert any("deepstack" in n and want[n].abs().max() > 0 for n in want)
    assert split_items(model, tree, 128) >= 1   # an image cut across chunks
    for budget in BUDGETS:
        res, got = streamed(model, tree, budget, ctx)
        assert res.forwards >= (4 if budget == 128 else 1)
        compare(res.logprobs, got, ref, want, dtype)


def test_qwen3_5_hybrid_vl_tree_streamed_equals_each_sequence_alone(precision_for):
    """Qwen3.5 (Gated DeltaNet + attention decoder, vision tower): float64 only -- in float32 the GDN scan's
    different chunking of a sequence alone shows at ~2e-3 relative on its decay parameters (test_hybrids.py)."""
    pytest.importorskip("transformers", minversion="5")
    from test_hybrids import _qwen3_5_vl

    model = _qwen3_5_vl(F64)
    stock = copy.deepcopy(model)
    flexgroup.patch(model)
    tree = vl_tree("qwen3_vl")
    ctx = precision_for(F64)[0]
    with ctx:
        ref = alone(stock, *tree, F64)
    want = grads(stock)
    assert any(n.startswith("model.visual.") for n in want)
    for budget in (128, 1024):
        res, got = streamed(model, tree, budget, ctx)
        compare(res.logprobs, got, ref, want, F64)


def test_checkpointing_and_lora_on_decoder_and_tower_stream_exactly(precision_for):
    """Training mode with non-reentrant gradient checkpointing (decoder and tower recomputed), then LoRA adapters
    on the decoder's and the tower's attention (PEFT), float32: every gradient as each sequence alone."""
    kind = "qwen2_5_vl"
    model, tree, ref, want, ctx = setup(kind, F32, precision_for)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    res, got = streamed(model, tree, 128, ctx)
    compare(res.logprobs, got, ref, want, F32)
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                           target_modules=["q_proj", "v_proj", "qkv"])
    torch.manual_seed(1)
    model = peft.get_peft_model(make_vl(kind, F32), lora)
    stock = copy.deepcopy(model)
    flexgroup.patch(model, backend="sdpa")
    ref = alone(stock.base_model.model, *tree, F32)
    want = grads(stock)
    assert any("visual" in n and "lora" in n for n in want)
    res, got = streamed(model, tree, 128, ctx)
    compare(res.logprobs, got, ref, want, F32)


def test_stream_logprobs_with_vision_and_temperature(precision_for):
    model = make_vl("qwen2_5_vl", F64)
    stock = copy.deepcopy(model)
    flexgroup.patch(model, backend="sdpa")
    seqs, vision, masks, adv = vl_tree("qwen2_5_vl")
    with precision_for(F64)[0]:
        ref = alone(stock, seqs, vision, masks, adv, F64, temperature=0.7)
        lp = flexgroup.stream_logprobs(model, seqs, loss_masks=masks, budget=128, vision=vision, temperature=0.7)
    assert (lp - ref.detach()).abs().max().item() <= 1e-10
    assert all(p.grad is None for p in model.parameters())


def test_tower_runs_once_per_distinct_image_or_video():
    model = flexgroup.patch(make_vl("qwen2_vl"), backend="sdpa")
    seqs, vision, masks, adv = vl_tree("qwen2_vl")
    seen = []
    h = model.model.visual.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        flexgroup.stream_logprobs(model, seqs, loss_masks=masks, budget=128, vision=vision)
    finally:
        h.remove()
    # distinct items: turn-1 image (8x8 patches), turn-2 image and its other-pixels twin (8x12 each), the video
    # (2x4x8); the turn-1 image is shown 5 times and the turn-2 image 3 times, the tower encodes each once
    assert sorted(seen) == [2 * 4 * 8, 8 * 8 + 8 * 12 + 8 * 12]


def _one_d_positions(monkeypatch):
    bind = StreamVision.bind

    def wrong(self, trie):
        bind(self, trie)
        for path in trie.paths:
            self.mrope[:, path] = torch.arange(len(path))   # text positions on all three rows

    monkeypatch.setattr(StreamVision, "bind", wrong)


def _tower_gradient_dropped(monkeypatch):
    monkeypatch.setattr(StreamVision, "backward", lambda self: None)


def _wrong_image(monkeypatch):
    bind = StreamVision.bind

    def wrong(self, trie):
        bind(self, trie)
        n = self.offsets[1]  # the first item's rows read the next item's features
        self.rows = torch.where(self.rows >= 0, (self.rows + n) % self.offsets[-1], -1)

    monkeypatch.setattr(StreamVision, "bind", wrong)


_deepstack = StreamVision.deepstack
BROKEN = {"1-D positions": _one_d_positions, "tower gradient dropped": _tower_gradient_dropped,
          "wrong image": _wrong_image,
          "deepstack dropped": lambda mp: mp.setattr(StreamVision, "deepstack",
                                                     lambda self, deep: _deepstack(self, None))}


@pytest.mark.parametrize("variant", list(BROKEN))
def test_broken_variants_fail_the_comparison(variant, monkeypatch, precision_for):
    model, tree, ref, want, ctx = setup("qwen3_vl", F64, precision_for)
    res, got = streamed(model, tree, 128, ctx)
    compare(res.logprobs, got, ref, want, F64)          # the right code passes ...
    BROKEN[variant](monkeypatch)
    res, got = streamed(model, tree, 128, ctx)
    with pytest.raises(AssertionError):                 # ... the broken one fails
        compare(res.logprobs, got, ref, want, F64)


def test_loud_on_what_cannot_be_exact(tiny_model, monkeypatch):
    seqs, vision, masks, _ = vl_tree("qwen2_vl")
    loss = lambda lp, i: lp.sum()  # noqa: E731
    text = flexgroup.patch(tiny_model("llama"), backend="sdpa")
    with pytest.raises(ValueError, match=r"vision= was given but LlamaForCausalLM \(llama\) has no vision tower.*"
                                         r"streaming x vision-language"):
        flexgroup.stream_backward(text, [s % 60 for s in seqs], loss, budget=128, vision=vision)
    vl = flexgroup.patch(make_vl("qwen2_vl"), backend="sdpa")
    with pytest.raises(ValueError, match="5 visual inputs for 6 sequences"):
        flexgroup.stream_backward(vl, seqs, loss, budget=128, vision=vision[:-1])
    with pytest.raises(ValueError, match=r"sequence 0 has 40 image placeholder tokens .* gives 56"):
        flexgroup.stream_backward(vl, seqs, loss, budget=128, vision=[vision[3]] + vision[1:])  # wrong images
    with pytest.raises(ValueError, match=r"sequence 0 has 40 image placeholder tokens .* gives 0"):
        flexgroup.stream_backward(vl, seqs, loss, budget=128, vision=[None] + vision[1:])     # images left out
    monkeypatch.setattr(stream_vision, "SUPPORTED", ("qwen2_5_vl", "qwen3_vl"))           # a model type not handled
    with pytest.raises(NotImplementedError, match="streaming x vision-language on qwen2_vl is not supported"):
        flexgroup.stream_backward(vl, seqs, loss, budget=128, vision=vision)
    with pytest.raises(NotImplementedError, match="streaming x vision-language on qwen2_vl is not supported.*raise "
                                                  "the budget"):
        flexgroup.stream_backward(vl, [s[s < 100].repeat(2) for s in seqs], loss, budget=128)  # text only, no vision=


@pytest.mark.parametrize("how", ["dropout_module", "functional_draw"])
def test_random_ops_in_the_tower_while_streaming_are_refused_as_in_a_grouped_forward(how):
    """Issue 38 item 5: the tower runs once per distinct item outside the decoder's watched forward; a draw in it
    (an ``nn.Dropout`` in a block, or any draw of the generator) is refused, naming the cause, as the non-streamed
    ``MultimodalGroupedBatch`` forward refuses it; ``shared_prefix_dropout=True`` accepts it; without draws (eval
    mode) the stream still runs."""
    seqs, vision, masks, adv = vl_tree("qwen2_vl")
    loss = lambda lp, i: lp.sum()  # noqa: E731

    def tower_model(shared=False):
        model = make_vl("qwen2_vl")
        block = model.model.visual.blocks[0]
        if how == "dropout_module":
            block.mlp.act = torch.nn.Sequential(block.mlp.act, torch.nn.Dropout(0.3))
        else:   # a draw with no module to find (e.g. F.dropout or noise in the tower's code)
            block.mlp.register_forward_hook(lambda m, a, out: out + 0.01 * torch.randn_like(out) if m.training
                                            else out)
        return flexgroup.patch(model, shared_prefix_dropout=shared).train()

    want = r"dropout is active in training mode.*blocks\.0\.mlp" if how == "dropout_module" else \
        r"random op ran during a grouped forward \(training mode; the CPU random generator advanced"
    with pytest.raises(RuntimeError, match=want):
        flexgroup.stream_backward(tower_model(), seqs, loss, loss_masks=masks, budget=128, vision=vision)
    flexgroup.stream_backward(tower_model(shared=True), seqs, loss, loss_masks=masks, budget=128, vision=vision)
    flexgroup.stream_logprobs(tower_model().eval(), seqs, loss_masks=masks, budget=128, vision=vision)


def test_the_processors_one_dict_for_the_whole_batch_is_split_per_sequence_or_refused_clearly():
    """Issue 38 item 7: ``vision=`` given as the processor's one mapping (every sequence's visual inputs
    concatenated in order) raised ``dictionary update sequence element #0 has length 1``; it is split by each
    sequence's placeholders (the same numbers as one entry per sequence), or refused naming the forms expected."""
    from flexgroup.data.multimodal import MultimodalGroupedBatch

    seqs, vision, masks, _ = vl_tree("qwen2_vl")
    whole = _cat(*vision)                      # what a processor returns for the batch
    model = flexgroup.patch(make_vl("qwen2_vl"))
    per_seq = flexgroup.stream_logprobs(model, seqs, loss_masks=masks, budget=128, vision=vision)
    assert torch.equal(flexgroup.stream_logprobs(model, seqs, loss_masks=masks, budget=128, vision=whole), per_seq)
    a = MultimodalGroupedBatch.from_sequences(seqs, masks, model=model, vision=vision)
    b = MultimodalGroupedBatch.from_sequences(seqs, masks, model=model, vision=whole)
    assert a.vision_inputs.keys() == b.vision_inputs.keys()
    assert all(torch.equal(a.vision_inputs[k], b.vision_inputs[k]) for k in a.vision_inputs)
    prompts = [s[:40] for s in seqs[:2]]       # from_groups: the two prompts' images, one mapping
    g1 = MultimodalGroupedBatch.from_groups(prompts, [[s[40:45]] for s in seqs[:2]], model=model,
                                            vision=_cat(*[{k: x[:16 * 4] if k == "pixel_values" else x[:1]
                                                           for k, x in vision[i].items()} for i in range(2)]))
    assert g1.vision_inputs["image_grid_thw"].shape[0] == 2
    with pytest.raises(ValueError, match=r"vision= is one mapping, read as the processor's output for all 6 "
                                         r"sequences in order, but it does not split into them.*one entry per sequence"):
        flexgroup.stream_logprobs(model, seqs, loss_masks=masks, budget=128, vision=vision[0])
    with pytest.raises(ValueError, match=r"vision= takes one entry per sequence .* got a Tensor"):
        MultimodalGroupedBatch.from_sequences(seqs, masks, model=model, vision=whole["pixel_values"])
    with pytest.raises(ValueError, match=r"vision entry 0 is a Tensor"):
        MultimodalGroupedBatch.from_sequences(seqs, masks, model=model, vision=[whole["pixel_values"]] + vision[1:])
