"""The GRPO adapter's per-token entropies equal TRL's.

Oracle: each row's real tokens alone through a stock, unpatched model loaded from the same
checkpoint, its logits divided by TRL's temperature, through TRL's own ``entropy_from_logits``
(float64, norms kept in float64). A 16k vocabulary and a scaled LM head give logits tens of nats
apart, where an entropy computed as ``logsumexp(x) - sum(softmax(x) * x)`` (no shift by the maximum)
is biased low by ~2e-5 nats in float32, ten times the stock trainer's own error (its fused head
shifts by the maximum, as flexgroup does).
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from _trainers import word_tokenizer  # noqa: E402

VOCAB = 16384     # a real vocabulary's size: the unshifted formula's error grows with it
HEAD_SCALE = 30.0
T = 0.7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random 2-layer Llama with a 16k-row LM head (the word tokenizer uses ids < 29 only)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama_entropy")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return str(path)


def _rows():
    """6 rows [Lp + Lc]: left-padded prompts (two prompts, one repeated outside its group), right-padded completions."""
    g = torch.Generator().manual_seed(5)
    p1, p2 = torch.randint(3, 29, (7,), generator=g), torch.randint(3, 29, (4,), generator=g)
    prompts = [p1, p1, p1, p2, p2, p1]
    comps = [torch.randint(3, 29, (n,), generator=g) for n in (3, 6, 1, 5, 2, 4)]
    Lp, Lc = 7, 6
    ids = torch.zeros(6, Lp + Lc, dtype=torch.long)
    am = torch.zeros(6, Lp + Lc, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        ids[i, Lp - len(p):Lp], am[i, Lp - len(p):Lp] = p, 1
        ids[i, Lp:Lp + len(c)], am[i, Lp:Lp + len(c)] = c, 1
    return ids, am, Lc


def _trainer(model_dir, tmp_path, dtype):
    import datasets

    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, num_generations=3,
                          max_completion_length=6, report_to="none", use_cpu=True, bf16=False, fp16=False,
                          temperature=T, beta=0.0,
                          model_init_kwargs={"dtype": dtype, "attn_implementation": "sdpa"})
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=args, train_dataset=datasets.Dataset.from_dict({"prompt": ["a b c"] * 3}),
                              processing_class=word_tokenizer())
    with torch.no_grad():
        trainer.model.lm_head.weight.mul_(HEAD_SCALE)
    return trainer


def _truth(model_dir, ids, am, k, keep64):
    """[rows, k] entropies: each row's real tokens alone through a stock float64 model, TRL's entropy_from_logits."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import entropy_from_logits

    stock = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa").eval()
    out = torch.zeros(ids.shape[0], k, dtype=torch.float64)
    with torch.no_grad(), keep64:
        stock.lm_head.weight.mul_(HEAD_SCALE)
        for i in range(ids.shape[0]):
            real = am[i].bool()
            logits = stock(input_ids=ids[i, real][None], use_cache=False).logits[0] / T   # [n, V]
            ent = entropy_from_logits(logits)                                            # [n]
            n_comp = int(am[i, -k:].sum())
            out[i, :n_comp] = ent[-n_comp - 1:-1]       # the rows that predict the completion tokens
    return out


def _entropies(trainer, ids, am, k):
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, k, batch_size=4,
                                                          compute_entropy=True)[1]


def test_entropies_equal_trl_entropy_from_logits_in_float64(model_dir, tmp_path, precision_for):
    from flexgroup.integrations.trl import patch_trainer

    keep64 = precision_for(torch.float64)[0]
    ids, am, k = _rows()
    cmask = am[:, -k:].bool()
    truth = _truth(model_dir, ids, am, k, keep64)
    trainer = patch_trainer(_trainer(model_dir, tmp_path, torch.float64), backend="sdpa")
    with keep64:
        ours = _entropies(trainer, ids, am, k)
    assert ours.dtype == torch.float64 and truth[cmask].mean() > 0.1   # not degenerate
    err = (ours - truth)[cmask].abs().max().item()
    assert err <= 1e-11, f"float64 entropy error {err:.3g}"
    assert (ours[~cmask] == 0).all()


def test_entropies_are_within_stock_trl_noise_in_float32(model_dir, tmp_path, precision_for):
    from flexgroup.integrations.trl import patch_trainer

    ids, am, k = _rows()
    cmask = am[:, -k:].bool()
    truth = _truth(model_dir, ids, am, k, precision_for(torch.float64)[0])
    trainer = _trainer(model_dir, tmp_path, torch.float32)
    stock = _entropies(trainer, ids, am, k)
    ours = _entropies(patch_trainer(trainer, backend="sdpa"), ids, am, k)
    stock_err, err = (stock.double() - truth)[cmask], (ours.double() - truth)[cmask]
    print(f"\nfloat32 entropy error vs float64 truth: flexgroup max {err.abs().max():.2e} mean {err.mean():.2e}, "
          f"stock TRL max {stock_err.abs().max():.2e} mean {stock_err.mean():.2e}")
    noise = stock_err.abs().max().item()
    assert err.abs().max().item() <= noise, f"flexgroup {err.abs().max():.3g} vs stock TRL's own error {noise:.3g}"
    assert abs(err.mean().item()) <= noise / 4, f"flexgroup entropies are biased by {err.mean():.3g}"
