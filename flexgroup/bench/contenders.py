"""Contenders for the benchmarks: what a user would otherwise run, side by side with flexgroup.

Every contender computes the same thing for one group (a prompt ``P`` and G responses ``R_i``):
the log-probability of every response token given ``[P; R_i[:t]]`` -- the policy log-prob pass of
a GRPO step -- as a right-padded FloatTensor [G, max_R] (zeros at padding). ``step()`` runs that
pass forward and backward (loss = minus the sum of the log-probs).

Model level (``MODEL_CONTENDERS``):

- ``baseline``: the stock model (sdpa), a right-padded batch of the G sequences ``[P; R_i]``, logits
  only for the completion positions (``logits_to_keep``), as TRL's trainer does it.
- ``flexgroup``: ``flexgroup.patch`` + ``GroupedBatch`` (one packed row, shared prefix).
- ``flexgroup-full-logits`` / ``prefix-grouper-full-logits``: the same with logits for every row of
  the packed row (the plain ``batch.logprobs`` API path / the package's ``split_output`` path);
  by default both keep only the rows that predict response tokens, like the baseline.
- ``prefix-grouper``: the PyPI package ``prefix-grouper`` (the PrefixGrouper paper's code): its
  ``PrefixGrouper.forward`` (two attention calls per layer: the prefix on itself, then every
  response against the prefix K/V copied G times) driven through :func:`pg_exact_sdpa`, an exact
  SDPA adapter, registered as a transformers attention function. The package's own hook
  (``register_attention``) does not run on transformers 5 (it hands a 2-D padding mask to the
  stock sdpa function, which needs 4-D; "eager" is not in the function table; flash-attn 2 is
  CUDA-only) and, on SDPA, would align the causal mask top-left, which is wrong for the suffix call.

Attention level (``ATTENTION_CONTENDERS``): baseline (padded batch of G causal sequences),
``flexgroup.attention`` (one backend), dense-mask SDPA on the packed row, the PrefixGrouper
two-call algorithm (package code + :func:`pg_exact_sdpa`).

transformers and prefix_grouper are imported lazily, inside the functions that need them.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..layout import Layout
from ..models.zoo import flops_per_token_and_pair

__all__ = ["llama_config", "qwen3_4b_config", "model_flops",
           "make_group", "pg_exact_sdpa", "pg_available", "MODEL_CONTENDERS", "ATTENTION_CONTENDERS",
           "AttentionInputs"]

PG_ATTN_NAME = "prefix_grouper_exact_sdpa"


# ---------------------------------------------------------------------------------- model shapes
def llama_config(hidden: int = 256, layers: int = 4, heads: int = 8, kv_heads: int = 4,
                 intermediate: int = 1024, vocab: int = 1024):
    """A small Llama config (random weights are built from it; nothing is downloaded)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                       max_position_embeddings=65536, attention_dropout=0.0, tie_word_embeddings=False)


def qwen3_4b_config(layers: int = 36):
    """Qwen3-4B's shape (hidden 2560, 32/8 heads of 128, MLP 9728, vocab 151936), ``layers`` layers."""
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       max_position_embeddings=40960, rope_theta=1_000_000.0, tie_word_embeddings=True,
                       attention_dropout=0.0)


def model_flops(cfg, tokens: int, pairs: int, logit_tokens: int, backward: bool = True) -> float:
    """Exact useful FLOPs of a pass: all layers' (tokens x per-token + pairs x per-pair) + the LM head.

    ``tokens``/``pairs`` per layer (e.g. ``Cost.grouped_tokens``/``grouped_pairs``); the FLOP model is
    :func:`flexgroup.models.zoo.flops_per_token_and_pair`; backward counts 2x forward.
    """
    per_token, per_pair = flops_per_token_and_pair(cfg)
    fwd = tokens * per_token + pairs * per_pair + 2 * cfg.hidden_size * cfg.vocab_size * logit_tokens
    return fwd * (3 if backward else 1)


def make_group(prefix_len: int, response_lens: Sequence[int], vocab: int, seed: int = 0
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Random token ids: prompt LongTensor [P], responses list of LongTensor [R_i]."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab, (prefix_len,), generator=g)
    return prompt, [torch.randint(1, vocab, (int(n),), generator=g) for n in response_lens]


def _pad(seqs: Sequence[torch.Tensor], value=0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(list(seqs), batch_first=True, padding_value=value)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [G, T, V] predicting targets [G, T] -> FloatTensor [G, T] log-probs, 0 where ~mask."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # half precision: log-softmax in float32
    lp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp * mask


# ---------------------------------------------------------------------------------- PrefixGrouper
def pg_available() -> bool:
    try:
        import prefix_grouper  # noqa: F401
    except ImportError:
        return False
    return True


def pg_exact_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor, *,
                  scale: float | None = None) -> torch.Tensor:
    """Exact attention function for ``PrefixGrouper.forward`` on SDPA.

    Args:
        q: [N, Hq, Lq, D]; k, v: [N, Hkv, Lk, D] with ``Lk >= Lq`` (GQA when Hq != Hkv).
        key_valid: BoolTensor [N, Lk], False at padding keys (PrefixGrouper's 2-D mask).

    Returns:
        [N, Lq, Hq, D] (PrefixGrouper's ``group`` expects sequence-major outputs).

    The rule is the one flash-attn varlen applies to PrefixGrouper's calls: causal aligned to the
    bottom-right (query i sees keys ``j <= i + Lk - Lq``) and only valid keys. The prefix call
    (``Lk == Lq``, left-padded) is then plain causal; the suffix call (``[prefix K; own K]``) sees
    the whole prefix and its own earlier tokens. Padding queries also see their diagonal key so no
    row is empty (their outputs are discarded by PrefixGrouper). With no padding and ``Lk == Lq``
    the causal kernel is used, as flash-attn would.
    """
    lq, lk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    off = lk - lq
    key_valid = key_valid.to(q.device)
    if off == 0 and bool(key_valid.all()):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        allowed = ((j - off <= i)[None] & key_valid[:, None, :]) | (j - off == i)[None]
        if gqa and q.device.type == "cuda":  # CUDA's masked (efficient) kernel lacks GQA: repeat K/V as HF does
            rep = q.shape[1] // k.shape[1]
            k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def _pg_hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     prefix_grouper=None, **kwargs):
    """transformers attention function: PrefixGrouper's two calls with :func:`pg_exact_sdpa`."""
    if prefix_grouper is None:
        raise ValueError(f"attention '{PG_ATTN_NAME}' needs model(..., prefix_grouper=PrefixGrouper(...))")
    if dropout and module.training:
        raise ValueError(f"attention dropout {dropout} in training: not supported by this adapter")
    out = prefix_grouper.forward(pg_exact_sdpa, query, key, value, scale=scaling)
    return out, None


def _register_pg() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PG_ATTN_NAME, _pg_hf_attention)


# ---------------------------------------------------------------------------------- model contenders
class _ModelContender:
    name = "?"

    def __init__(self, model, prompt: torch.Tensor, responses: Sequence[torch.Tensor]):
        self.device = next(model.parameters()).device
        self.prompt, self.responses = prompt, list(responses)
        self.layout = Layout.group(len(prompt), [len(r) for r in responses])
        self.targets = _pad(responses).to(self.device)                          # [G, Rmax]
        self.mask = _pad([torch.ones(len(r)) for r in responses]).to(self.device)  # [G, Rmax]
        lay, last = self.layout, self.layout.lengths[0] - 1
        rows = [torch.tensor([last] + list(range(lay.starts[s], lay.starts[s] + lay.lengths[s] - 1)))
                for s in range(1, lay.num_segments)]
        # packed-row positions whose logits predict the targets (the last prompt row predicts every R_i[0])
        self.rows = _pad(rows, value=last).to(self.device)                      # [G, Rmax]

    def logprobs(self) -> torch.Tensor:
        """FloatTensor [G, max_R]: log p(R_i[t] | P, R_i[:t]), 0 at padding."""
        raise NotImplementedError

    def step(self) -> torch.Tensor:
        """One forward+backward of the log-prob pass; returns the (detached) loss."""
        self.model.zero_grad(set_to_none=True)
        loss = -self.logprobs().sum()
        loss.backward()
        return loss.detach()

    def forward_loss(self) -> torch.Tensor:
        return -self.logprobs().sum()


class BaselineContender(_ModelContender):
    """Stock model, sdpa, right-padded batch [G, P + max_R], logits for completions only."""

    name = "baseline"

    def __init__(self, model, prompt, responses):
        super().__init__(model, prompt, responses)
        self.model = copy.deepcopy(model)
        self.model.set_attn_implementation("sdpa")
        seqs = [torch.cat([prompt, r]) for r in responses]
        self.ids = _pad(seqs).to(self.device)
        self.attn = _pad([torch.ones(len(s), dtype=torch.long) for s in seqs]).to(self.device)
        self.keep = self.targets.shape[1] + 1

    def logprobs(self):
        out = self.model(input_ids=self.ids, attention_mask=self.attn, use_cache=False,
                         logits_to_keep=self.keep)
        return token_logprobs(out.logits[:, :-1], self.targets, self.mask)


class FlexgroupContender(_ModelContender):
    """``flexgroup.patch(model, backend)`` + ``GroupedBatch.from_groups``: one packed row.

    ``keep_logits=True`` (default) asks the LM head only for the rows that predict response tokens
    (``logits_to_keep`` = an index tensor, as the baseline keeps only completion rows);
    ``keep_logits=False`` is the plain API path: logits for all L rows, then ``batch.logprobs``.
    """

    name = "flexgroup"

    def __init__(self, model, prompt, responses, backend: str = "auto", keep_logits: bool = True):
        super().__init__(model, prompt, responses)
        import flexgroup
        from flexgroup import GroupedBatch

        self.model = flexgroup.patch(copy.deepcopy(model), backend=backend)
        self.batch = GroupedBatch.from_groups([prompt], [list(responses)])
        self.inputs = self.batch.model_inputs(self.device)
        self.keep_logits = keep_logits

    def logprobs(self):
        if not self.keep_logits:
            out = self.model(**self.inputs)
            return self.batch.logprobs(out.logits) * self.mask      # [G, max_R], responses in input order
        out = self.model(**self.inputs, logits_to_keep=self.rows.flatten())
        logits = out.logits.view(*self.rows.shape, -1)              # [G, Rmax, V]
        return token_logprobs(logits, self.targets, self.mask)


class PrefixGrouperContender(_ModelContender):
    """The ``prefix-grouper`` package through :func:`pg_exact_sdpa` (see module docstring).

    ``keep_logits=True`` (default) gives it the same LM-head treatment as the other contenders
    (logits only for the rows that predict response tokens), so the comparison is of the attention
    algorithm; ``keep_logits=False`` is the package's own path: logits for all L rows, then
    ``PrefixGrouper.split_output(include_prefix_last=1)``.
    """

    name = "prefix-grouper"

    def __init__(self, model, prompt, responses, keep_logits: bool = True):
        super().__init__(model, prompt, responses)
        from prefix_grouper import PrefixGrouper

        _register_pg()
        self.model = copy.deepcopy(model)
        self.model.set_attn_implementation(PG_ATTN_NAME)
        self.pg = PrefixGrouper([[len(prompt), *[len(r) for r in responses]]], device=self.device)
        self.ids = torch.cat([prompt, *responses])[None].to(self.device)
        self.pos = self.layout.position_ids[None].to(self.device)   # virtual positions
        self.keep_logits = keep_logits

    def logprobs(self):
        kw = dict(input_ids=self.ids, position_ids=self.pos, prefix_grouper=self.pg, use_cache=False)
        if self.keep_logits:
            out = self.model(**kw, logits_to_keep=self.rows.flatten())
            return token_logprobs(out.logits.view(*self.rows.shape, -1), self.targets, self.mask)
        out = self.model(**kw)
        # the last prefix position predicts every response's first token: include_prefix_last=1
        _, _, suffix_logits, _ = self.pg.split_output(out.logits, include_prefix_last=1)
        return token_logprobs(suffix_logits[:, :-1], self.targets, self.mask)


MODEL_CONTENDERS: dict[str, Callable] = {
    "baseline": BaselineContender,
    "flexgroup": FlexgroupContender,
    "flexgroup-full-logits": lambda m, p, r: FlexgroupContender(m, p, r, keep_logits=False),
    "flexgroup-sdpa": lambda m, p, r: FlexgroupContender(m, p, r, backend="sdpa"),
    "flexgroup-lse": lambda m, p, r: FlexgroupContender(m, p, r, backend="lse"),
    "prefix-grouper": PrefixGrouperContender,
    "prefix-grouper-full-logits": lambda m, p, r: PrefixGrouperContender(m, p, r, keep_logits=False),
}


# ---------------------------------------------------------------------------------- attention level
class AttentionInputs:
    """Random q/k/v of one group, packed ``[1, H, L, D]`` and as the padded baseline batch.

    The baseline tensors are gathered from the packed ones along each path, so outputs are comparable:
    ``baseline_out[g, :, :n_g] == packed_out[0, :, paths[g]]``.
    """

    def __init__(self, layout: Layout, heads: int = 8, kv_heads: int = 4, head_dim: int = 32,
                 dtype=torch.float32, device="cpu", seed: int = 0, requires_grad: bool = True):
        g = torch.Generator().manual_seed(seed)
        L = layout.num_tokens
        self.layout, self.requires_grad = layout, requires_grad
        mk = lambda h: torch.randn(1, h, L, head_dim, generator=g).to(device=device, dtype=dtype)  # noqa: E731
        self.q, self.k, self.v = mk(heads), mk(kv_heads), mk(kv_heads)
        self.paths = layout.paths()
        self.lens = [len(p) for p in self.paths]
        if len(set(self.lens)) != 1:
            raise ValueError("attention contenders need equal response lengths (no padding in the baseline)")
        idx = torch.stack(self.paths).to(device)
        self.qb, self.kb, self.vb = (t[0][:, idx].transpose(0, 1).contiguous() for t in (self.q, self.k, self.v))
        self.scale = head_dim ** -0.5

    def leaves(self, packed: bool) -> tuple[torch.Tensor, ...]:
        ts = (self.q, self.k, self.v) if packed else (self.qb, self.kb, self.vb)
        return tuple(t.detach().requires_grad_(self.requires_grad) for t in ts)

    def unpack(self, out: torch.Tensor) -> torch.Tensor:
        """packed out [1, H, L, D] -> [G, H, n, D] along the paths (for comparison)."""
        return torch.stack([out[0][:, p] for p in self.paths])


# Each returns (fn, to_paths, leaves): fn() -> raw output (what is timed); to_paths(out) -> [G, Hq, n, D];
# leaves: the (q, k, v) tensors fn reads (requires_grad when the inputs were built for training).
def attn_baseline(x: AttentionInputs):
    q, k, v = x.leaves(packed=False)
    gqa = q.shape[1] != k.shape[1]
    return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=x.scale, enable_gqa=gqa),
            lambda out: out, (q, k, v))


def attn_flexgroup(x: AttentionInputs, backend: str = "sdpa"):
    from ..kernels import attention

    q, k, v = x.leaves(packed=True)
    return lambda: attention(q, k, v, x.layout, scale=x.scale, backend=backend), x.unpack, (q, k, v)


def attn_dense(x: AttentionInputs):
    q, k, v = x.leaves(packed=True)
    mask = x.layout.dense_mask().to(q.device)
    gqa = q.shape[1] != k.shape[1]
    return (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=x.scale, enable_gqa=gqa),
            x.unpack, (q, k, v))


def attn_prefix_grouper(x: AttentionInputs):
    from prefix_grouper import PrefixGrouper

    q, k, v = x.leaves(packed=True)
    pg = PrefixGrouper([list(x.layout.lengths)], device=q.device)
    if x.layout.parents != (-1,) + (0,) * (x.layout.num_segments - 1):
        raise ValueError("PrefixGrouper handles one-level groups only")
    return (lambda: pg.forward(pg_exact_sdpa, q, k, v, scale=x.scale),
            lambda out: x.unpack(out.transpose(1, 2)), (q, k, v))


ATTENTION_CONTENDERS: dict[str, Callable] = {
    "baseline": attn_baseline,
    "flexgroup": attn_flexgroup,
    "flexgroup-flex": lambda x: attn_flexgroup(x, backend="flex"),
    "flexgroup-lse": lambda x: attn_flexgroup(x, backend="lse"),
    "dense-sdpa": attn_dense,
    "prefix-grouper": attn_prefix_grouper,
}
