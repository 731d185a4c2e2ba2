"""lm-evaluation-harness model ``flexgroup``: HFLM with shared-context log-likelihoods.

``FlexGroupLM`` is lm-eval's ``HFLM`` (same arguments: ``pretrained``, ``tokenizer``, ``device``,
``dtype``, ...) whose token-level log-likelihood path (``_loglikelihood_tokens``, used by
``loglikelihood`` and ``loglikelihood_rolling``) packs requests with a prefix trie
(:mod:`flexgroup.train.evaluation`): the choices of a question share their context and questions share
their few-shot examples. Generation (``generate_until``) is HFLM's own. Extra arguments:

- ``max_tokens`` (default 8192): token budget of one packed row (replaces ``batch_size`` for
  log-likelihoods);
- ``flexgroup_backend`` (default ``"auto"``): attention backend for :func:`flexgroup.patch`.

``device`` defaults to ``"cuda"`` when CUDA is available and ``"cpu"`` otherwise (HFLM's default is
always ``"cuda"``); an explicit CUDA device without CUDA is refused.

Use it from Python (importing this module registers the name)::

    import lm_eval, flexgroup.integrations.lm_eval
    lm_eval.simple_evaluate(model="flexgroup", model_args="pretrained=./my-model,max_tokens=4096", tasks=[...])

or from the shell, ``python -m flexgroup.integrations.lm_eval run --model flexgroup --model_args
pretrained=./my-model --tasks ...`` (lm-eval's own command line with the model registered).
Requests are truncated exactly as HFLM does: the model is fed the last ``max_length`` tokens of
``context + continuation`` without its final token (the context is cut from the left), so requests
longer than ``max_length`` and every ``loglikelihood_rolling`` window (HFLM's own windowing, which
calls ``_loglikelihood_tokens``) are scored as HFLM scores them.
"""

from __future__ import annotations

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # pragma: no cover - exercised only without lm-eval
    raise ImportError('flexgroup.integrations.lm_eval needs lm-evaluation-harness: pip install -e ".[eval]" in the flexgroup clone') from e

import flexgroup
from flexgroup.train.scoring import score_sequences

__all__ = ["FlexGroupLM"]


def _no_cuda_message(device: str) -> str:
    """Why ``device`` (a CUDA device) cannot be used: a CPU-only build, or a CUDA build that sees no GPU."""
    if torch.version.cuda is None:
        return (f"FlexGroupLM: device={device!r} but this PyTorch build is CPU-only ({torch.__version__}): pass "
                "device='cpu' (the default without CUDA), or install a CUDA build of torch")
    return (f"FlexGroupLM: device={device!r} but this PyTorch build supports CUDA {torch.version.cuda} "
            f"({torch.__version__}) and sees no GPU: check the GPU and its driver (nvidia-smi) and "
            "CUDA_VISIBLE_DEVICES, or pass device='cpu'")


@register_model("flexgroup")
class FlexGroupLM(HFLM):
    """lm-eval's ``HFLM`` with log-likelihood requests scored through shared-prefix packed rows."""

    def __init__(self, *args, max_tokens: int = 8192, flexgroup_backend: str = "auto", **kwargs):
        device = kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        if isinstance(device, str) and device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(_no_cuda_message(device))
        super().__init__(*args, **kwargs)
        if self.backend != "causal":
            raise ValueError(f"FlexGroupLM: only decoder-only (causal) models are supported, got backend "
                             f"{self.backend!r}")
        self.flexgroup_max_tokens = int(max_tokens)
        self.flexgroup_backend = flexgroup_backend
        self.flexgroup_stats = {"grouped_tokens": 0, "baseline_tokens": 0, "rows": 0}
        flexgroup.patch(self.model, backend=flexgroup_backend)   # once; ungrouped calls (generation) are unchanged

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """``requests``: ``((context_str, continuation_str) or None, context_ids, continuation_ids)``;
        returns ``(log-likelihood, is_greedy)`` per request, in order (HFLM's contract)."""
        if not requests:
            return []
        seqs, starts = [], []
        for _, ctx, cont in requests:
            if not ctx or not cont or len(cont) > self.max_length:
                raise ValueError(f"FlexGroupLM: a request has {len(ctx)} context and {len(cont)} continuation "
                                 f"tokens: both must be non-empty and the continuation at most max_length="
                                 f"{self.max_length}")
            # HFLM feeds (ctx + cont)[-(max_length + 1):][:-1]; the scorer feeds each sequence but its last token
            ids = (list(ctx) + list(cont))[-(self.max_length + 1):]
            seqs.append(torch.tensor(ids, dtype=torch.long))
            starts.append(len(ids) - len(cont))
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            res = score_sequences(self.model, seqs, starts, max_tokens=self.flexgroup_max_tokens, temperature=1.0,
                                   backend=self.flexgroup_backend, softmax_dtype=self.softmax_dtype)
        for key, value in (("grouped_tokens", res.grouped_tokens), ("baseline_tokens", res.baseline_tokens),
                           ("rows", res.rows)):
            self.flexgroup_stats[key] += value
        answers = [(float(s), bool(g)) for s, g in zip(res.sum_logprobs.tolist(), res.is_greedy.tolist())]
        for (request_str, _, _), answer in zip(requests, answers):
            if request_str is not None:  # rolling windows carry None and are cached per document by HFLM
                self.cache_hook.add_partial("loglikelihood", request_str, answer)
        return answers


if __name__ == "__main__":  # pragma: no cover - lm-eval's command line with "flexgroup" registered
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
