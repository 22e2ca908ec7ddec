#!/usr/bin/env python
"""Time and activation memory of (ckpt, offload alpha) variants on CPU, PP ranks over gloo.

Every rank builds its stage of the same small Llama-style GPTModel, installs the h3t-ext schedules
with each variant's H3TConfig and runs a few iterations. Printed per variant: time per iteration
relative to ckpt=no / alpha=0, and every stage's peak of saved activation bytes (counted by the
activation manager) next to the cost model's ``stage_activation_peak_bytes`` (fp32, 'local' spec,
no sequence parallel, t=1), which includes the last stage's output layer (final norm, fp32 softmax
and targets of the cross entropy) and the local spec's unfused RoPE cos/sin. ckpt=no runs the
local spec's norms and SwiGLU saving what fused kernels save (h3t_ext.runtime.modules.fused_saves, applied
by the runtime), as the cost model counts.

    .venv/bin/python scripts/bench_runtime.py [--iterations 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB = 256
DEFAULT_VARIANTS = "no:0,no:0.5,no:1,ours:0,ours:0.5,ours:1"


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pipeline-model-parallel-size", type=int, default=4)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--ffn-hidden-size", type=int, default=256)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--num-query-groups", type=int, default=2)
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=1,
                    help="l; L/p means plain 1F1B (default 1: interleaved, v = L/p)")
    ap.add_argument("--num-microbatches", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=3, help="timed iterations (after one warm-up)")
    ap.add_argument("--device-mode", default="cpu-sync", choices=["cpu-sync", "cpu-thread"])
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma list of ckpt:alpha")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.variant_list = [(c, float(a)) for c, a in (v.split(":") for v in args.variants.split(","))]
    except ValueError:
        ap.error(f"--variants must look like 'no:0,ours:0.5', got {args.variants!r}")
    bad = [v for v in args.variant_list if v[0] not in ("no", "ours") or not 0 <= v[1] <= 1]
    if bad:
        ap.error(f"--variants: ckpt must be no|ours and alpha in [0, 1], got {bad}")
    per_rank = args.num_layers // args.pipeline_model_parallel_size
    if args.num_layers % args.pipeline_model_parallel_size or per_rank % args.num_layers_per_virtual_pipeline_stage:
        ap.error("--num-layers must be divisible by --pipeline-model-parallel-size times "
                 "--num-layers-per-virtual-pipeline-stage")
    args.v = per_rank // args.num_layers_per_virtual_pipeline_stage
    return args


def _worker(rank, world, args):
    import warnings

    warnings.filterwarnings("ignore", module="megatron")  # optional-accelerator notices at import
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from h3t_training.training import forward_step  # the driver's own step and loss

    from h3t_ext.runtime.memory.activations import ActivationManager
    from h3t_ext.runtime.config import H3TConfig
    from h3t_ext.runtime.memory.device import make_device_layer
    from h3t_ext.runtime.modules.gpt import build_stage_chunks, tiny_llama_config
    from h3t_ext.runtime.pipeline.schedules import H3TSchedules

    def measuring_factory(cfg, pp_rank, pp_size, device):  # a manager even at ckpt=no, alpha=0
        return ActivationManager(cfg.stage_alpha(pp_rank, pp_size), make_device_layer(cfg.device_mode, device),
                                 min_offload_bytes=cfg.min_offload_bytes)

    def batches():
        g = torch.Generator().manual_seed(7)
        s, b = args.seq_length, args.micro_batch_size
        for _ in range(args.num_microbatches):
            tok = torch.randint(0, VOCAB, (b, s), generator=g)
            yield {"tokens": tok, "labels": torch.roll(tok, -1, 1), "loss_mask": torch.ones(b, s),
                   "position_ids": torch.arange(s).unsqueeze(0).expand(b, s)}

    ps.initialize_model_parallel(pipeline_model_parallel_size=world,
                                 virtual_pipeline_model_parallel_size=args.v if args.v > 1 else None)
    p, v = world, args.v
    # the plain baseline (no manager) runs first and last in every round, to expose drift and order effects
    variants = [("no", 0.0, False)] + [(c, a, True) for c, a in args.variant_list] + [("no", 0.0, False)]
    runs = []
    for ckpt, alpha, measure in variants:  # ckpt=no, alpha=0 first: the plain baseline, no manager
        cfg = tiny_llama_config(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                                num_query_groups=args.num_query_groups, pipeline_model_parallel_size=p,
                                virtual_pipeline_model_parallel_size=v if v > 1 else None)
        torch.manual_seed(0)
        model = build_stage_chunks(cfg, vocab_size=VOCAB, max_sequence_length=args.seq_length, pipeline_rank=rank,
                                   ckpt=ckpt)
        sched = H3TSchedules(H3TConfig(ckpt=ckpt, offload_alpha=alpha, device_mode=args.device_mode),
                             manager_factory=measuring_factory if measure else None)
        runs.append((model, sched))
    times = [[] for _ in runs]
    for it in range(args.iterations + 1):  # round robin, so machine load hits every variant alike
        for i, (model, sched) in enumerate(runs):
            dist.barrier()
            t0 = time.perf_counter()
            run = sched.forward_backward_pipelining_with_interleaving if v > 1 else \
                sched.forward_backward_pipelining_without_interleaving
            run(forward_step_func=forward_step, data_iterator=[batches() for _ in model] if v > 1 else batches(),
                model=model if v > 1 else model[0], num_microbatches=args.num_microbatches,
                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False)
            for chunk in model:
                chunk.zero_grad(set_to_none=True)
            dist.barrier()
            if it:
                times[i].append(time.perf_counter() - t0)
    results = []
    for (ckpt, alpha, measure), (_, sched), ts in zip(variants, runs, times):
        mgrs = [m for m in sched.preparer.managers if m is not None]
        results.append({"ckpt": ckpt, "offload_alpha": alpha, "measured": measure,
                        "seconds": min(ts),  # least disturbed by other load on the machine
                        "peak": mgrs[0].stats.peak_resident_bytes if mgrs else None})
    return results


def _predicted(args, ckpt, alpha):
    from h3t_ext.costmodel.activations import stage_activation_peak_bytes
    from h3t_ext.costmodel.plan import Plan
    from h3t_ext.costmodel.specs import ModelSpec

    spec = ModelSpec("bench", args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups,
                     args.ffn_hidden_size, VOCAB)
    p = args.pipeline_model_parallel_size
    plan = Plan(num_gpus=p, seq_length=args.seq_length, global_batch_size=args.num_microbatches * args.micro_batch_size,
                micro_batch_size=args.micro_batch_size, pipeline_model_parallel_size=p, ckpt=ckpt,
                offload_alpha=alpha, num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage)
    return list(stage_activation_peak_bytes(spec, plan, dtype_bytes=4, layer_spec="local", sequence_parallel=False))


def main(argv=None) -> int:
    args = _parse(argv)
    from h3t_ext.testing import run_distributed

    per_rank = run_distributed(_worker, args.pipeline_model_parallel_size, (args,), timeout_s=1800)
    base = max(0.5 * (r[0]["seconds"] + r[-1]["seconds"]) for r in per_rank)
    rows = []
    for i, v in enumerate(per_rank[0][1:-1], start=1):
        rows.append({
            "ckpt": v["ckpt"], "offload_alpha": v["offload_alpha"],
            "time_ratio": round(max(r[i]["seconds"] for r in per_rank) / base, 4),
            "stage_peak_bytes": [r[i]["peak"] for r in per_rank],
            "predicted_stage_peak_bytes": _predicted(args, v["ckpt"], v["offload_alpha"]),
        })
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"PP={args.pipeline_model_parallel_size} v={args.v} L={args.num_layers} h={args.hidden_size} "
          f"m={args.num_microbatches} device={args.device_mode}; plain baseline ckpt=no alpha=0: {base:.3f} s/iter "
          f"(first {max(r[0]['seconds'] for r in per_rank):.3f}, last {max(r[-1]['seconds'] for r in per_rank):.3f})")
    print(f"{'ckpt':5s} {'alpha':>5s} {'time':>6s}  stage peaks measured / predicted (MB)")
    for r in rows:
        pairs = "  ".join(f"{m / 1e6:.3f}/{q / 1e6:.3f}" for m, q in zip(r["stage_peak_bytes"],
                                                                    r["predicted_stage_peak_bytes"]))
        print(f"{r['ckpt']:5s} {r['offload_alpha']:5.2f} {r['time_ratio']:6.3f}  {pairs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
