"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL: grouped multimodal forward == each [P; R_i] alone, stock model.

Oracle: a deep copy of the unpatched model, given ``[P; R_i]`` with that prompt's own visual inputs
and ``mm_token_type_ids``, computing its M-RoPE positions itself. Compared: M-RoPE ids, logits on
every root-to-leaf path, per-response log-probs, and every parameter gradient (decoder AND
vision tower) of a GRPO-style loss; float32 and float64.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import flexgroup
from flexgroup.data.multimodal import MultimodalGroupedBatch

V, IMG, VID, VS, VE, TS = 128, 120, 121, 122, 123, 124  # vocab; image/video placeholders; vision start/end; timestamp
MODELS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
PATCH_DIM = 3 * 2 * 2 * 2  # channels * temporal_patch * patch * patch
SECONDS = 1.5  # Qwen2.5-VL second_per_grid_ts; with tokens_per_second=2 temporal ids step by 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny matmuls: intra-op threads only add barrier waits (measured 5x slower with 2 threads on a busy box)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_vl(kind: str, dtype=torch.float32, seed: int = 0):
    """A tiny random Qwen-VL model (2 decoder layers, 1-2 vision blocks), stock sdpa, eval mode.

    ``"qwen2_vl_windowed"``: Qwen2-VL whose second decoder layer has a 4-token sliding window.
    """
    import transformers as tf

    windowed = kind.endswith("_windowed")
    kind = kind.removesuffix("_windowed")

    text = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, attention_dropout=0.0, bos_token_id=1,
                eos_token_id=2, rope_theta=10000.0, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    if windowed:
        text.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    vis = dict(patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_heads=2)
    toks = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    if not hasattr(tf, {"qwen2_vl": "Qwen2VLConfig", "qwen2_5_vl": "Qwen2_5_VLConfig", "qwen3_vl": "Qwen3VLConfig"}[kind]):
        pytest.skip(f"{kind} is not in transformers {tf.__version__}")
    if kind == "qwen2_vl":
        cfg = tf.Qwen2VLConfig(text_config=text, vision_config=dict(vis, depth=1, embed_dim=16, hidden_size=32,
                                                                     mlp_ratio=2), **toks)
        cls = tf.Qwen2VLForConditionalGeneration
    elif kind == "qwen2_5_vl":
        cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=dict(
            vis, depth=2, hidden_size=16, intermediate_size=24, out_hidden_size=32, window_size=8,
            fullatt_block_indexes=[1], tokens_per_second=2), **toks)
        cls = tf.Qwen2_5_VLForConditionalGeneration
    else:
        text = {k: v for k, v in text.items() if k not in ("rope_scaling", "rope_theta")}  # transformers 5 only
        text = dict(text, head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "mrope_section": [2, 1, 1], "mrope_interleaved": True})
        cfg = tf.Qwen3VLConfig(text_config=text, vision_config=dict(
            vis, depth=2, hidden_size=16, intermediate_size=24, out_hidden_size=32, num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1]), **toks)
        cls = tf.Qwen3VLForConditionalGeneration
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


class Prompt:
    """Builds a prompt's token ids and its visual inputs, as a Qwen-VL processor would."""

    def __init__(self, kind: str, gen: torch.Generator):
        self.kind, self.gen = kind, gen
        self.ids: list[int] = []
        self.vision: dict[str, list] = {}

    def text(self, n: int) -> "Prompt":
        self.ids += torch.randint(3, 100, (n,), generator=self.gen).tolist()
        return self

    def image(self, h: int, w: int, closed: bool = True) -> "Prompt":
        self._add("pixel_values", "image_grid_thw", (1, h, w))
        self.ids += [VS] + [IMG] * (h * w // 4) + ([VE] if closed else [])
        return self

    def video(self, t: int, h: int, w: int) -> "Prompt":
        self._add("pixel_values_videos", "video_grid_thw", (t, h, w))
        self.vision.setdefault("second_per_grid_ts", []).append(SECONDS)
        if self.kind == "qwen3_vl":  # one placeholder run per frame, separated by timestamp text
            for _ in range(t):
                self.ids += [TS, VS] + [VID] * (h * w // 4) + [VE]
        else:
            self.ids += [VS] + [VID] * (t * h * w // 4) + [VE]
        return self

    def _add(self, pix: str, grid: str, thw: tuple[int, int, int]):
        n = thw[0] * thw[1] * thw[2]
        self.vision.setdefault(pix, []).append(torch.randn(n, PATCH_DIM, generator=self.gen))
        self.vision.setdefault(grid, []).append(torch.tensor([thw]))

    def build(self) -> tuple[torch.Tensor, dict | None]:
        v = {k: (torch.tensor(x) if k == "second_per_grid_ts" else torch.cat(x)) for k, x in self.vision.items()}
        if self.kind != "qwen2_5_vl":
            v.pop("second_per_grid_ts", None)
        return torch.tensor(self.ids), (v or None)


def case(name: str, kind: str, seed: int = 0):
    """-> prompts, responses, vision (one entry per prompt)."""
    g = torch.Generator().manual_seed(seed)
    P = lambda: Prompt(kind, g)  # noqa: E731
    if name == "image":
        groups = [(P().text(3).image(4, 4).text(2), [4, 2, 5])]
    elif name == "video":
        groups = [(P().text(2).video(2, 4, 4).text(2), [3, 5])]
    elif name == "two_images_ending_with_image":  # the prompt ends inside a visual block
        groups = [(P().text(2).image(4, 4).text(1).image(4, 6, closed=False), [3, 1, 4])]
    elif name == "mixed_groups":  # image + video in one prompt, a text-only prompt, an image prompt
        groups = [(P().text(1).image(4, 4).text(2).video(2, 4, 4).text(1), [2, 4]), (P().text(5), [3]),
                  (P().text(2).image(4, 6).text(1), [1, 3])]
    elif name == "text_only":
        groups = [(P().text(7), [3, 5])]
    elif name == "two_groups":
        groups = [(P().text(2).image(4, 4).text(2), [3, 4]), (P().text(1).image(6, 4).text(3), [5, 1, 2])]
    else:
        raise KeyError(name)
    prompts, vision = zip(*(p.build() for p, _ in groups))
    responses = [[torch.randint(3, 100, (n,), generator=g) for n in lens] for _, lens in groups]
    return list(prompts), responses, list(vision)


CASES = ["image", "video", "two_images_ending_with_image", "text_only", "two_groups", "mixed_groups"]


def _stock_inputs(model, p, r, v) -> dict:
    x = torch.cat([p, r])[None]
    # an explicit all-ones mask: transformers 4.x reads row 0 of 3-row ids as text positions and, with
    # no mask, would split the sequence at every image (packed-sequence detection) in the baseline itself
    kw = dict(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False, **(v or {}))
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # transformers >= 5
        kw["mm_token_type_ids"] = (x == IMG).int() + 2 * (x == VID).int()
    return kw


def _baseline(stock, prompts, responses, vision):
    """Each [P; R_i] alone through the stock model: per response (logits [P+R, V], log-probs [R])."""
    logits, lps = [], []
    for p, rs, v in zip(prompts, responses, vision):
        for r in rs:
            out = stock(**_stock_inputs(stock, p, r, v)).logits[0]
            logits.append(out)
            lps.append(torch.log_softmax(out[len(p) - 1:len(p) + len(r) - 1], -1).gather(1, r[:, None])[:, 0])
    return logits, lps


@pytest.mark.parametrize("kind", MODELS)
def test_mrope_ids_restricted_to_each_sequence_equal_the_models_own(kind):
    model = make_vl(kind)
    for name in CASES:
        prompts, responses, vision = case(name, kind)
        batch = MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)
        pos = batch.model_inputs()["position_ids"]
        assert pos.shape == (3, 1, batch.num_tokens)
        paths = iter(batch.layout.paths())
        for p, rs, v in zip(prompts, responses, vision):
            for r in rs:
                kw = _stock_inputs(model, p, r, v)
                args = {k: kw[k] for k in ("mm_token_type_ids", "image_grid_thw", "video_grid_thw",
                                           "second_per_grid_ts", "attention_mask") if k in kw}
                ref, _ = model.model.get_rope_index(kw["input_ids"], **args)
                assert torch.equal(pos[:, 0, next(paths)], ref[:, 0]), (name, p.tolist(), r.tolist())


# float64 runs keep the norms in float64 (conftest's precision_for)
EQUIV = [(k, n, d) for k in MODELS for n in CASES for d in (torch.float32, torch.float64)]
EQUIV += [("qwen2_vl_windowed", n, d) for n in ("image", "mixed_groups") for d in (torch.float32, torch.float64)]


@pytest.mark.parametrize("kind,name,dtype", EQUIV, ids=lambda x: {torch.float32: "f32", torch.float64: "f64"}.get(x, x))
def test_grouped_logits_logprobs_and_all_grads_equal_baseline(kind, name, dtype, precision_for, hf_oracle):
    ctx, atol, rel = precision_for(dtype)
    model = make_vl(kind, dtype)
    stock = copy.deepcopy(model)  # deep copy before patching: config included
    flexgroup.patch(model, backend="sdpa")
    prompts, responses, vision = case(name, kind)
    batch = MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)
    adv = torch.linspace(-1.0, 1.5, batch.num_responses, dtype=dtype)
    with ctx:
        out = model(**batch.model_inputs()).logits
        lp = batch.logprobs(out)
        (lp * adv[:, None]).sum().backward()
        ref_logits, ref_lps = _baseline(stock, prompts, responses, vision)
        hf_oracle.loss(ref_lps, adv.tolist()).backward()
    for path, ref in zip(batch.layout.paths(), ref_logits):
        torch.testing.assert_close(out[0, path], ref, atol=10 * atol, rtol=0)
    for i, ref in enumerate(ref_lps):
        n = batch.response_lengths[i]
        assert batch.response_mask[i].sum() == n
        assert (lp[i, :n] - ref).abs().max() <= atol
    got, want = hf_oracle.grads(model), hf_oracle.grads(stock)
    assert any(n.startswith("model.visual.") for n in want) == (name != "text_only")
    hf_oracle.assert_grads_close(got, want, rel)
    if kind == "qwen3_vl" and name != "text_only":  # deepstack features really reach the decoder
        assert any("deepstack" in n and want[n].abs().max() > 0 for n in want)


def test_vision_tower_encodes_each_prompt_once_and_keeps_its_attention():
    model = make_vl("qwen2_5_vl")
    vision_impl = model.config.vision_config._attn_implementation
    flexgroup.patch(model, backend="sdpa")
    assert model.config.vision_config._attn_implementation == vision_impl
    assert model.config.text_config._attn_implementation.startswith("flexgroup_")
    prompts, responses, vision = case("two_groups", "qwen2_5_vl")
    batch = MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)
    rows = []
    hook = model.model.visual.register_forward_hook(lambda m, a, k: rows.append(a[0].shape[0]))
    try:
        model(**batch.model_inputs())
    finally:
        hook.remove()
    assert rows == [sum(v["pixel_values"].shape[0] for v in vision)]  # one call, each prompt's patches once
    assert flexgroup.patches.is_patched(model)
    flexgroup.unpatch(model)
    assert not flexgroup.patches.is_patched(model)
    assert model.config.text_config._attn_implementation == "sdpa"
    assert model.config.vision_config._attn_implementation == vision_impl


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_from_padded_with_per_row_visual_inputs_matches_baseline(kind, hf_oracle):
    model = make_vl(kind)
    stock = copy.deepcopy(model)
    flexgroup.patch(model, backend="sdpa")
    prompts, responses, vision = case("two_groups", kind)
    rows = [(g, r) for g in range(len(prompts)) for r in responses[g]]
    lp_, lc = max(len(p) for p in prompts), max(len(r) for _, r in rows)
    pid = torch.zeros(len(rows), lp_, dtype=torch.long)
    pm, cid, cm = torch.zeros_like(pid), torch.zeros(len(rows), lc, dtype=torch.long), torch.zeros(len(rows), lc)
    for i, (g, r) in enumerate(rows):
        pid[i, lp_ - len(prompts[g]):], pm[i, lp_ - len(prompts[g]):] = prompts[g], 1
        cid[i, :len(r)], cm[i, :len(r)] = r, 1
    per_row = [vision[g] for g, _ in rows]  # a trainer collates every row's own copy
    mm = {k: torch.cat([v[k] for v in per_row]) for k in per_row[0]}
    batch = MultimodalGroupedBatch.from_padded(pid, pm, cid, cm, group_ids=[g for g, _ in rows], model=model, **mm)
    lp = batch.logprobs(model(**batch.model_inputs()).logits)
    assert lp.shape == (len(rows), lc)
    _, ref = _baseline(stock, prompts, responses, vision)
    for i, want in enumerate(ref):
        assert (lp[i, :len(want)] - want).abs().max() <= 1e-5
    bad = dict(mm, pixel_values=mm["pixel_values"].clone())
    bad["pixel_values"][-1] += 1.0  # the last row's image differs from its group's first row
    with pytest.raises(ValueError, match="different visual inputs"):
        MultimodalGroupedBatch.from_padded(pid, pm, cid, cm, group_ids=[g for g, _ in rows], model=model, **bad)


def test_response_with_image_tokens_is_refused():
    model = make_vl("qwen2_vl")
    prompts, responses, vision = case("image", "qwen2_vl")
    responses[0][1] = torch.tensor([5, IMG, 6])
    with pytest.raises(ValueError, match="response 1 .*placeholder token id 120"):
        MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)


def test_visual_inputs_that_do_not_fill_the_placeholders_are_refused():
    model = make_vl("qwen2_vl")
    prompts, responses, vision = case("image", "qwen2_vl")
    v = dict(vision[0], image_grid_thw=torch.tensor([[1, 4, 8]]))
    with pytest.raises(ValueError, match="image_grid_thw"):
        MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=[v])
    with pytest.raises(ValueError, match="4 image placeholder tokens .* gives 0"):
        MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=[None])


def test_images_in_another_order_than_their_placeholders_are_refused():
    """Two images of 2 and 4 placeholders given as [4-token item, 2-token item]: the totals agree, and the stock
    model runs silently (its first image's features spill into the second's run); the batch refuses, naming it."""
    model = make_vl("qwen2_vl")
    g = torch.Generator().manual_seed(0)
    p, v = Prompt("qwen2_vl", g).text(2).image(2, 4).text(1).image(4, 4).text(1).build()
    swapped = {"pixel_values": torch.cat([v["pixel_values"][8:], v["pixel_values"][:8]]),
               "image_grid_thw": v["image_grid_thw"][[1, 0]]}
    r = torch.tensor([5, 6])
    with torch.no_grad():
        model(**_stock_inputs(model, p, r, swapped))   # the oracle itself does not notice
    seq = torch.cat([p, r])
    for vision in ([swapped], swapped):   # one entry per sequence, or one mapping split by the placeholders
        with pytest.raises(ValueError, match=r"runs of placeholder tokens \(id 120\) have \[2, 4\] tokens but the "
                                             r"image_grid_thw items give \[4, 2\]"):
            MultimodalGroupedBatch.from_sequences([seq], model=model, vision=vision)
    MultimodalGroupedBatch.from_sequences([seq], model=model, vision=[v])   # in order: accepted


def test_unpatched_vl_model_never_returns_numbers_for_grouped_inputs():
    model = make_vl("qwen3_vl")
    prompts, responses, vision = case("image", "qwen3_vl")
    batch = MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)
    with pytest.raises(RuntimeError, match="flexgroup.patch"):
        model(**batch.model_inputs())


def test_patched_vl_model_still_runs_ordinary_inputs_and_patch_is_idempotent():
    model = make_vl("qwen3_vl")
    stock = copy.deepcopy(model)
    flexgroup.patch(model, backend="sdpa")
    flexgroup.patch(model, backend="sdpa")
    prompts, responses, vision = case("mixed_groups", "qwen3_vl")
    kw = _stock_inputs(model, prompts[0], responses[0][1], vision[0])
    torch.testing.assert_close(model(**kw).logits, stock(**kw).logits, atol=1e-6, rtol=0)


def test_gradient_checkpointing_in_training_mode_matches_baseline(hf_oracle):
    model = make_vl("qwen2_5_vl")
    stock = copy.deepcopy(model)
    flexgroup.patch(model, backend="sdpa")
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    assert model.model.language_model.gradient_checkpointing
    model.train()
    prompts, responses, vision = case("mixed_groups", "qwen2_5_vl")
    batch = MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)
    batch.logprobs(model(**batch.model_inputs()).logits).sum().backward()
    _, ref = _baseline(stock, prompts, responses, vision)
    sum(r.sum() for r in ref).backward()
    hf_oracle.assert_grads_close(hf_oracle.grads(model), hf_oracle.grads(stock), 1e-4)


@pytest.mark.parametrize("kind", ["qwen2_vl_windowed", "qwen3_vl"])
def test_eval_no_grad_through_the_flex_backend(kind):
    model = make_vl(kind)
    stock = copy.deepcopy(model)
    flexgroup.patch(model, backend="flex_eager")
    prompts, responses, vision = case("mixed_groups", kind)
    batch = MultimodalGroupedBatch.from_groups(prompts, responses, model=model, vision=vision)
    with torch.no_grad():
        lp = batch.logprobs(model(**batch.model_inputs()).logits)
        _, ref = _baseline(stock, prompts, responses, vision)
    for i, want in enumerate(ref):
        assert (lp[i, :len(want)] - want).abs().max() <= 1e-5


def test_text_batch_with_visual_placeholders_is_refused_by_the_patched_model():
    model = make_vl("qwen2_vl")
    flexgroup.patch(model, backend="sdpa")
    prompts, responses, vision = case("image", "qwen2_vl")
    batch = flexgroup.GroupedBatch.from_groups(prompts, responses)  # 1-D positions: wrong for image tokens
    with pytest.raises(ValueError, match="3-row M-RoPE ids"):
        model(**batch.model_inputs(), **vision[0])
