"""TRL GRPO adapter with a per-forward token budget: streamed old / reference / policy passes give the
stock trainer's step.

Oracle: the stock, unpatched ``trl.GRPOTrainer``; same seed, same (replayed) completions, one step.
Prompts of 150-200 tokens and 3 completions each, so with ``flexgroup_budget=128`` every chunk of rows
is streamed (each prompt is itself cut into chunks whose keys and values later chunks read).
``num_iterations=2`` (the old policy's pass runs), ``beta=0.1`` (the reference model's), temperature
0.7. Compared: the loss, every parameter gradient, and the per-token log-probs of each role (rows
matched by their tokens: the stock trainer shuffles rows, the adapter whole groups). float64, with
HF's float32 norm upcasts kept in float64 in both runs (``KeepFloat64``).
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_trl import G, _config, _fix_generations, _reward  # noqa: E402

from _trainers import LETTERS, Recording, save_tiny_llama, word_tokenizer  # noqa: E402

from flexgroup.integrations import trl_stream  # noqa: E402
from flexgroup.integrations.trl import FlexGroupGRPOTrainer, patch_trainer  # noqa: E402

BUDGET = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_budget"), max_positions=512)


def _dataset():
    g = torch.Generator().manual_seed(4)
    return datasets.Dataset.from_dict({"prompt": [
        " ".join(LETTERS[int(t)] for t in torch.randint(0, 26, (n,), generator=g)) for n in (150, 200)]})


class LogpRecorder:
    """Records the log-probs ``_get_per_token_logps_and_entropies`` returns, per role, keyed by each row's tokens."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                         **kwargs)
        role = "ref" if model is getattr(self, "ref_model", None) else (
            "policy" if torch.is_grad_enabled() else "old")
        rec = self.__dict__.setdefault("recorded_logps", {}).setdefault(role, {})
        for ids, m, lp in zip(input_ids, attention_mask, out[0].detach()):   # completion tokens only (TRL 0.20
            rec[tuple(ids[m.bool()].tolist())] = lp * m[-logits_to_keep:]      # scores padding too, flexgroup 0)
        return out


class Stock(Recording, LogpRecorder, trl.GRPOTrainer):
    pass


class Budgeted(Recording, LogpRecorder, FlexGroupGRPOTrainer):
    pass


def _args(tmp_path):
    return _config(tmp_path)   # float32; TRL's own gradient-checkpointing default (non-reentrant where it is on)


def _step(cls, model_dir, tmp_path, **kw):
    trainer = cls(model=model_dir, reward_funcs=_reward, args=_args(tmp_path), train_dataset=_dataset(),
                  processing_class=word_tokenizer(), **kw)
    _fix_generations(trainer)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def stock(model_dir, tmp_path_factory):
    return _step(Stock, model_dir, tmp_path_factory.mktemp("stock"))


def _assert_same_step(got, ref, rel=1e-5):
    torch.testing.assert_close(got.recorded_loss, ref.recorded_loss, rtol=1e-5, atol=1e-6)
    assert set(got.recorded_logps) == set(ref.recorded_logps) == {"policy", "old", "ref"}
    for role, rows in ref.recorded_logps.items():
        assert got.recorded_logps[role].keys() == rows.keys() and len(rows) == 2 * G
        for key, lp in rows.items():
            err = (got.recorded_logps[role][key] - lp).abs().max().item()
            assert err <= 2e-6, f"{role} log-probs differ by {err:.3g}"
    assert got.recorded_grads.keys() == ref.recorded_grads.keys() and len(ref.recorded_grads) > 0
    for name, gb in ref.recorded_grads.items():
        scale = gb.abs().max().item()
        err = (got.recorded_grads[name] - gb).abs().max().item()
        assert scale > 0 and err <= rel * scale, f"{name}: grad error {err:.3g}, grad scale {scale:.3g}"


def test_streamed_old_ref_and_policy_passes_give_the_stock_step(model_dir, tmp_path, stock):
    got = _step(Budgeted, model_dir, tmp_path, flexgroup_backend="sdpa", flexgroup_budget=BUDGET)
    _assert_same_step(got, stock)
    s = got.flexgroup_stats
    for role in ("policy", "old", "ref"):   # every chunk of rows streamed, in several forwards
        assert s[role]["streamed_forwards"] == s[role]["forwards"] > 2, dict(s[role])
    assert s["policy"]["recomputed_forwards"] * 2 == s["policy"]["forwards"]
    assert s["policy"]["recomputed_tokens"] == s["policy"]["grouped_tokens"]
    assert "streamed under the budget of 128 tokens" in got.flexgroup_report()


def test_a_budget_that_every_chunk_fits_gives_the_packed_path(model_dir, tmp_path, stock):
    got = _step(Budgeted, model_dir, tmp_path, flexgroup_backend="sdpa", flexgroup_budget=100_000)
    _assert_same_step(got, stock)
    assert all(s["streamed_forwards"] == 0 and s["forwards"] == 1 for s in got.flexgroup_stats.values())


def test_gradient_accumulation_over_streamed_micro_batches_equals_stock(model_dir, tmp_path):
    """Two micro-batches of one group each, accumulated: the policy node's backward adds to ``.grad``."""
    grads = {}
    for name, cls, kw in (("stock", Stock, {}), ("budget", Budgeted, {"flexgroup_backend": "sdpa",
                                                                      "flexgroup_budget": BUDGET})):
        args = _config(tmp_path / name, per_device_train_batch_size=G, steps_per_generation=2,
                       gradient_accumulation_steps=2, num_iterations=1, loss_type="grpo")   # split-independent
        trainer = cls(model=model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset(),
                      processing_class=word_tokenizer(), **kw)
        _fix_generations(trainer)
        trainer.train()
        grads[name] = trainer.recorded_grads
    assert trainer.flexgroup_stats["policy"]["recomputed_forwards"] >= 4   # both micro-batches streamed
    for name, gb in grads["stock"].items():
        scale = gb.abs().max().item()
        err = (grads["budget"][name] - gb).abs().max().item()
        assert scale > 0 and err <= 1e-5 * scale, f"{name}: grad error {err:.3g}, grad scale {scale:.3g}"


def _drop_loss_gradient(monkeypatch):
    real = trl_stream.StreamedRows.backward
    monkeypatch.setattr(trl_stream.StreamedRows, "backward", lambda self, g: real(self, torch.ones_like(g)))


def _ignore_temperature(monkeypatch):
    real = trl_stream.stream_forward
    monkeypatch.setattr(trl_stream, "stream_forward", lambda *a, temperature, **kw: real(*a, temperature=1.0, **kw))


@pytest.mark.parametrize("bug,match", [(_drop_loss_gradient, "grad error"), (_ignore_temperature, "log-probs differ")])
def test_a_broken_streamed_path_is_caught(bug, match, model_dir, tmp_path, stock, monkeypatch):
    bug(monkeypatch)
    got = _step(Budgeted, model_dir, tmp_path, flexgroup_backend="sdpa", flexgroup_budget=BUDGET)
    with pytest.raises(AssertionError, match=match):
        _assert_same_step(got, stock)


@pytest.mark.parametrize("budget,match", [(127, "below one block of 128"), (200.0, "must be an integer"),
                                          ("256", "must be an integer")])
def test_a_bad_budget_is_refused(budget, match, model_dir, tmp_path):
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=_reward, args=_args(tmp_path),
                              train_dataset=_dataset(), processing_class=word_tokenizer())
    with pytest.raises(ValueError, match=match):
        patch_trainer(trainer, backend="sdpa", budget=budget)
    assert type(trainer) is trl.GRPOTrainer       # left as it was


def _rows(lengths=(6, 2, 4)):
    """One group: a 150-token prompt (left-padded), completions of ``lengths`` (right-padded; 0: masked out,
    as TRL's mask_truncated_completions does): [rows, Lp + k] ids and mask, k."""
    g = torch.Generator().manual_seed(6)
    p = torch.randint(3, 29, (150,), generator=g)
    k = 6
    ids = torch.zeros(len(lengths), 152 + k, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, 2:152], am[i, 2:152] = p, 1
        ids[i, 152:152 + n], am[i, 152:152 + n] = torch.randint(3, 29, (n,), generator=g), 1
    return ids, am, k


def test_a_loss_through_the_streamed_entropies_is_refused(model_dir, tmp_path):
    trainer = patch_trainer(trl.GRPOTrainer(model=model_dir, reward_funcs=_reward, args=_args(tmp_path),
                                            train_dataset=_dataset(), processing_class=word_tokenizer()),
                            backend="sdpa", budget=BUDGET)
    ids, am, k = _rows()
    lp, ent = trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, k, compute_entropy=True)[:2]
    assert trainer.flexgroup_stats["policy"]["streamed_forwards"] > 1 and ent.requires_grad
    (lp.sum() + 0 * ent.sum()).backward(retain_graph=True)       # a zero entropy gradient is exact
    with pytest.raises(RuntimeError, match="differentiates through the entropies"):
        (lp.sum() + ent.sum()).backward()


def test_what_streaming_cannot_make_exact_is_refused_at_construction(model_dir, tmp_path):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    args = _config(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    fake = SimpleNamespace(accelerator=SimpleNamespace(distributed_type=DistributedType.NO), args=args)
    with pytest.raises(ValueError, match="use_reentrant': False"):
        trl_stream.check_trainer(fake, BUDGET)
    fake.args = _config(tmp_path)
    for sharded in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        fake.accelerator.distributed_type = sharded
        with pytest.raises(NotImplementedError, match="shards the parameters.*would hang.*Use data parallelism"):
            trl_stream.check_trainer(fake, BUDGET)
    fake.accelerator.distributed_type = DistributedType.MULTI_GPU   # DDP: supported (test_trl_distributed.py)
    assert trl_stream.check_trainer(fake, BUDGET) == BUDGET
    fake.accelerator.distributed_type = DistributedType.NO
    fake._entropy_bonus_enabled, fake.entropy_coef = True, 0.01
    with pytest.raises(NotImplementedError, match="entropy_coef=0.0"):
        trl_stream.check_trainer(fake, BUDGET)
    fake._entropy_bonus_enabled = False
    assert trl_stream.check_trainer(fake, BUDGET) == BUDGET


def test_streamed_passes_equal_each_row_alone_in_float64(model_dir, tmp_path, precision_for, monkeypatch):
    """float64 oracle (the stock trainer's fused head computes in float32): each row's real tokens alone
    through a stock float64 model, logits / temperature; log-probs, entropies, and every parameter
    gradient of ``sum(W * logps)`` through the streamed policy pass, and the no-grad (old) pass."""
    from transformers import AutoModelForCausalLM

    keep64, atol, rel = precision_for(torch.float64)
    real = trl_stream.StreamedRows.backward

    def backward_keeping_float64(self, g):   # PyTorch runs a backward outside the forward's TorchFunctionModes
        with type(keep64)():
            return real(self, g)

    monkeypatch.setattr(trl_stream.StreamedRows, "backward", backward_keeping_float64)
    args = _config(tmp_path, gradient_checkpointing=False,   # checkpointing recomputes in float32 under keep64
                   model_init_kwargs={"dtype": torch.float64, "attn_implementation": "sdpa"})
    trainer = patch_trainer(trl.GRPOTrainer(model=model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset(),
                                            processing_class=word_tokenizer()), backend="sdpa", budget=BUDGET)
    ids, am, k = _rows((6, 2, 4, 0))   # batch_size=2 below: two chunks of rows, the second with an empty completion
    W = torch.randn(ids.shape[0], k, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    stock = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa")
    T = trainer.temperature
    ref_lp, ref_ent = (torch.zeros(ids.shape[0], k, dtype=torch.float64) for _ in range(2))
    with keep64:
        lp, ent = trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, k, batch_size=2,
                                                             compute_entropy=True)[:2]
        (W * lp).sum().backward()
        with torch.no_grad():
            old = trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, k, batch_size=2)[0]
        for i in range(ids.shape[0]):
            real, n = am[i].bool(), int(am[i, -k:].sum())
            if n == 0:
                continue
            logp = torch.log_softmax(stock(input_ids=ids[i, real][None], use_cache=False).logits[0, -n - 1:-1] / T, -1)
            lp_i = logp.gather(1, ids[i, -k:][:n, None])[:, 0]
            (W[i, :n] * lp_i).sum().backward()
            ref_lp[i, :n], ref_ent[i, :n] = lp_i.detach(), -(logp.exp() * logp).sum(-1).detach()
    s = trainer.flexgroup_stats
    assert s["policy"]["streamed_forwards"] > 4 and s["old"]["streamed_forwards"] > 2, dict(s)
    for name, got, want in (("policy log-probs", lp, ref_lp), ("entropies", ent, ref_ent),
                            ("old log-probs", old, ref_lp)):
        assert got.dtype == torch.float64 and (got.detach() - want).abs().max().item() <= atol, name
    grads = {n: p.grad for n, p in stock.named_parameters()}
    for n, p in trainer.model.named_parameters():
        scale = grads[n].abs().max().item()
        err = (p.grad - grads[n]).abs().max().item()
        assert scale > 0 and err <= rel * scale, f"{n}: grad error {err:.3g}, grad scale {scale:.3g}"
