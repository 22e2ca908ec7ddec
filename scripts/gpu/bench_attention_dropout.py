#!/usr/bin/env python3
"""Attention dropout on this GPU: forward and backward of PyTorch's fused attention (each SDPA backend that
runs here: flash, cuDNN) at dropout 0 and 0.1, against the slowdowns the cost model states
(``attention_dropout_fwd_slowdown`` / ``attention_dropout_bwd_slowdown`` of
h3t_ext/data/fitted_efficiencies.json, taken from a Blackwell measurement). Default shape: the Megatron
H100 table's 1.7B row (micro batch 4, 16 heads, sequence 4096, head dim 128, causal, bf16).

  python scripts/gpu/bench_attention_dropout.py [--json]
  python scripts/gpu/bench_attention_dropout.py --device cpu --seq-length 128 --json   # code path only

Prints, per backend, the best time of each pass and slowdown = time with dropout / time without - 1
(``--json``: one object). A backend that refuses dropout or the shape is listed with its reason.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

DROPOUT = 0.1


def _timed(fn, device: str, repeats: int, setup=lambda: None) -> float:
    """Best seconds of ``fn(setup())`` over ``repeats`` after one warm-up (kernel selection, workspaces)."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn(setup())
    best = float("inf")
    for _ in range(repeats):
        arg = setup()
        sync()
        t0 = time.perf_counter()
        fn(arg)
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(backend: str, *, device: str, batch: int, heads: int, seq: int, head_dim: int, repeats: int) -> dict:
    """Best forward and backward seconds of one SDPA backend at dropout 0 and DROPOUT, and the slowdowns."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, generator=g, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, generator=g)
    kernel = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]
    out: dict = {}
    try:
        with sdpa_kernel([kernel]):
            for p in (0.0, DROPOUT):
                def forward(_=None, p=p):
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)

                out[f"fwd_s_p{p}"] = _timed(forward, device, repeats)
                out[f"bwd_s_p{p}"] = _timed(lambda o: o.backward(grad), device, repeats, setup=forward)
    except RuntimeError as e:
        return {"ran": False, "why": str(e).strip().splitlines()[0][:200]}
    out["ran"] = True
    for pass_ in ("fwd", "bwd"):
        base = out[f"{pass_}_s_p0.0"]
        out[f"{pass_}_slowdown"] = out[f"{pass_}_s_p{DROPOUT}"] / base - 1 if base > 0 else None
    return out


def main(argv=None) -> int:
    from h3t_training.config.arguments import OneLineParser

    ap = OneLineParser(prog="bench_attention_dropout.py", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--num-attention-heads", type=int, default=16)
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--kv-channels", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for name in ("micro_batch_size", "num_attention_heads", "seq_length", "kv_channels", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_attention_dropout.py: error: no CUDA GPU (use --device cpu to exercise the code path)",
              file=sys.stderr)
        return 1
    from h3t_ext.costmodel.efficiency_sets import efficiency_set

    stated = efficiency_set("hopper")
    backends = ("flash", "cudnn") if args.device == "cuda" else ("math",)
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "shape": {"micro_batch_size": args.micro_batch_size, "num_attention_heads": args.num_attention_heads,
                  "seq_length": args.seq_length, "kv_channels": args.kv_channels, "causal": True},
        "dropout": DROPOUT,
        "stated": {"fwd_slowdown": stated["attention_dropout_fwd_slowdown"],
                   "bwd_slowdown": stated["attention_dropout_bwd_slowdown"]},
        "backends": {b: measure(b, device=args.device, batch=args.micro_batch_size, heads=args.num_attention_heads,
                                seq=args.seq_length, head_dim=args.kv_channels, repeats=args.repeats)
                     for b in backends},
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"attention dropout {DROPOUT} on {result['device']} (stated slowdowns: fwd "
          f"{result['stated']['fwd_slowdown']:.2f}, bwd {result['stated']['bwd_slowdown']:.2f})")
    for name, r in result["backends"].items():
        if not r["ran"]:
            print(f"  {name:6s} not run: {r['why']}")
            continue
        print(f"  {name:6s}" + "".join(
            f"   {pass_} {r[f'{pass_}_s_p0.0'] * 1e3:8.3f} -> {r[f'{pass_}_s_p{DROPOUT}'] * 1e3:8.3f} ms "
            f"({'n/a' if r[f'{pass_}_slowdown'] is None else format(r[f'{pass_}_slowdown'], '+.2f')})"
            for pass_ in ("fwd", "bwd")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
