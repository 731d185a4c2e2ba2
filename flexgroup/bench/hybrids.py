"""P8: a Qwen3.5-shaped hybrid (Gated DeltaNet + full attention) at the key point P=1024, G=8, R=128.

Model: ``qwen3_5_text`` from ``flexgroup.models.zoo`` at the demo size (hidden 256, MLP 1024, vocab
2048; full attention 8 query / 4 KV heads of 32) with Qwen3.5's 3:1 layer pattern (3 Gated DeltaNet
layers -- 2 key / 4 value heads of 32, conv kernel 4, chunk 64 -- then 1 full-attention layer),
random weights, float32, training mode, one torch thread. Contenders (``flexgroup.bench``): the stock
model on a padded batch of the G sequences ``[P; R_i]`` (``baseline``) and ``flexgroup.patch`` +
``GroupedBatch`` (state forked per segment), each one forward+backward of the log-prob loss, checked
against the baseline first, timed in interleaved rounds.

The ideal is the exact FLOP ratio of the decoder layers: per token, every Linear of every layer
plus the conv and the chunked gated-delta scan (both linear in tokens: their ratio is the token
ratio); per causal pair, QK^T and PV of the full-attention layers only.

    flexgroup bench hybrids [--rounds 3] [--out benchmarks/results/hybrids-1t.json]
"""

from __future__ import annotations

import argparse
import sys

import torch

from flexgroup import Layout
from .harness import format_point, run_model_point
from .measure import environment, write_json
from ..models.zoo import build_model

LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def hybrid_flops(config) -> tuple[float, float]:
    """(FLOPs per token, FLOPs per causal pair) of the decoder layers of a Qwen3.5-style config."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() for layer in model.model.layers for m in layer.modules()
                 if isinstance(m, torch.nn.Linear))
    k, v, hv = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_num_value_heads
    c, n_lin = 64, config.layer_types.count("linear_attention")
    conv_dim = 2 * config.linear_num_key_heads * k + hv * v
    # chunked gated delta rule per token and value head (MACs): k_beta K^T and Q K^T (C*K each), the two
    # unit-triangular solves (C*(K+V)/2), intra-chunk attention times values (C*V), and three state products (K*V)
    scan = hv * (c * (2 * k + (k + v) / 2 + v) + 3 * k * v)
    per_token = 2 * linear + n_lin * 2 * (scan + config.linear_conv_kernel_dim * conv_dim)
    n_full = config.layer_types.count("full_attention")
    per_pair = n_full * 4 * config.num_attention_heads * config.head_dim
    return float(per_token), float(per_pair)


def main(argv=None) -> int:
    """``flexgroup bench hybrids ...`` (the options: :func:`flexgroup.bench.options.parser`)."""
    from .options import parser

    return run(parser("hybrids").parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the workload with parsed ``args``; returns the exit status."""
    torch.set_num_threads(args.threads)
    model = build_model("qwen3_5_text", size="demo", layer_types=LAYER_TYPES).train()
    P, R, G = args.prefix, args.response, args.groups
    rec = run_model_point(model, P, R, G, contenders=["flexgroup"], repeats=args.rounds)
    rec["ideal"] = Layout.group(P, [R] * G).cost().ideal_speedup(*hybrid_flops(model.config))
    for key in ("speedup", "speedup_cpu"):
        rec[key + "_over_ideal"] = {n: s / rec["ideal"] for n, s in rec.get(key, {}).items() if n != "baseline"}
    rec["model"] = "qwen3_5_text demo size, layer_types " + ",".join(t[0] for t in LAYER_TYPES)
    rec["environment"] = environment()
    print(format_point(rec))
    for n, r in rec["results"].items():
        print(f"  {n}: median {r.get('median_s', float('nan')):.3f} s wall, {r.get('median_cpu_s', float('nan')):.3f} s "
              f"cpu, max |dlogp| {r.get('max_abs_err', float('nan')):.2e}, saved {r.get('saved_bytes', 0) / 2**20:.0f} MiB")
    print(f"  speedup over ideal: wall {rec['speedup_over_ideal']}, cpu {rec.get('speedup_cpu_over_ideal')}")
    if args.out:
        write_json(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
