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

``--vs-megatron`` instead times h3t-ext's executor against megatron-core's own schedule functions in
one run, on the same model chunks, data and layout (PP=2 without and with interleaving, v=1 and v=2;
ckpt=no, alpha=0): per layout, N warm-up then N timed iterations of each, alternating which runs first
(AB BA AB ...) so drift and order effects hit both alike. Printed per layout: the median step time of
each (slowest rank, barrier to barrier), their ratio, the median of the per-round ratios, the ratio of
the busiest rank's CPU time, and the largest relative difference of the per-microbatch losses and of the
gradients (float32 roundoff at most: the same ops run in the same order). Megatron runs with Megatron-LM's
defaults: batched transfers without interleaving, --overlap-p2p-communication with it.
On a host without CUDA megatron-core's schedules and P2PCommunicator see a ``torch`` whose
``cuda.current_device()`` is the CPU, ``cuda.synchronize()`` a no-op and ``zeros(device="cuda")`` a
CPU tensor (:func:`megatron_schedules_on_host`), for both schedules alike.

    .venv/bin/python scripts/bench_runtime.py --vs-megatron [--iterations 25] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB = 256
DEFAULT_VARIANTS = "no:0,no:0.5,no:1,ours:0,ours:0.5,ours:1"
VS_ITERATIONS = 25
VS_LAYOUTS = (1, 2)  # model chunks per pipeline rank: plain 1F1B, interleaved
SCHEDULES = ("megatron", "h3t")


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vs-megatron", action="store_true",
                    help="time h3t-ext's executor against megatron-core's schedule functions (PP=2, v=1 and v=2, "
                         "ckpt=no, alpha=0) instead of the ckpt x alpha variants")
    ap.add_argument("--pipeline-model-parallel-size", type=int, default=None,
                    help="p (default 4; 2 with --vs-megatron)")
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
    ap.add_argument("--iterations", type=int, default=None,
                    help="timed iterations (default 3, after one warm-up; --vs-megatron: 25 per schedule and "
                         "layout, after as many warm-up ones)")
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
    if args.pipeline_model_parallel_size is None:
        args.pipeline_model_parallel_size = 2 if args.vs_megatron else 4
    if args.iterations is None:
        args.iterations = VS_ITERATIONS if args.vs_megatron else 3
    if args.iterations < 1:
        ap.error("--iterations must be >= 1")
    if args.vs_megatron:
        if args.pipeline_model_parallel_size < 2:
            ap.error("--vs-megatron compares pipelined schedules: --pipeline-model-parallel-size must be >= 2")
        if args.num_layers % (2 * args.pipeline_model_parallel_size):
            ap.error("--vs-megatron runs v=2: --num-layers must be divisible by 2 x --pipeline-model-parallel-size")
        args.v = None
        return args
    per_rank = args.num_layers // args.pipeline_model_parallel_size
    if args.num_layers % args.pipeline_model_parallel_size or per_rank % args.num_layers_per_virtual_pipeline_stage:
        ap.error("--num-layers must be divisible by --pipeline-model-parallel-size times "
                 "--num-layers-per-virtual-pipeline-stage")
    args.v = per_rank // args.num_layers_per_virtual_pipeline_stage
    return args


def _batches(args):
    """The microbatches of one iteration (the same every iteration, on every rank and for every schedule)."""
    import torch

    g = torch.Generator().manual_seed(7)
    s, b = args.seq_length, args.micro_batch_size
    for _ in range(args.num_microbatches):
        tok = torch.randint(0, VOCAB, (b, s), generator=g)
        yield {"tokens": tok, "labels": torch.roll(tok, -1, 1), "loss_mask": torch.ones(b, s),
               "position_ids": torch.arange(s).unsqueeze(0).expand(b, s)}


def _worker(rank, world, args):
    import warnings

    warnings.filterwarnings("ignore", module="megatron")  # optional-accelerator notices at import
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from h3t_training.loop.training import forward_step  # the driver's own step and loss

    from h3t_ext.runtime.memory.activations import ActivationManager
    from h3t_ext.runtime.config import H3TConfig
    from h3t_ext.runtime.memory.device import make_device_layer
    from h3t_ext.runtime.modules.gpt import build_stage_chunks, tiny_llama_config
    from h3t_ext.runtime.pipeline.schedules import H3TSchedules

    def measuring_factory(cfg, pp_rank, pp_size, device):  # a manager even at ckpt=no, alpha=0
        return ActivationManager(cfg.stage_alpha(pp_rank, pp_size), make_device_layer(cfg.device_mode, device),
                                 min_offload_bytes=cfg.min_offload_bytes)

    def batches():
        return _batches(args)

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
                                   ckpt=ckpt, device_type="cpu")
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


# ---- --vs-megatron ----------------------------------------------------------------------------------

@contextlib.contextmanager
def megatron_schedules_on_host():
    """Let megatron-core 0.16's schedule functions and P2PCommunicator run on a host without CUDA.

    They take ``torch.cuda.current_device()`` as the device of every receive buffer, call
    ``torch.cuda.synchronize()`` after each batched transfer (``batch_p2p_sync``) and count tokens in
    ``torch.zeros([], device="cuda")``. While this is entered, the two modules' ``torch`` is a copy of
    torch's namespace whose ``cuda.current_device()`` is the CPU, ``cuda.synchronize()`` a no-op and
    ``zeros(device="cuda")`` a CPU tensor; everything else is torch's own object. Does nothing where CUDA
    is available. h3t-ext's executor calls megatron's ``forward_step``/``backward_step`` from the same
    module, so both schedules run under it alike.
    """
    import types

    import torch
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    if torch.cuda.is_available():
        yield
        return
    cuda = types.ModuleType("torch.cuda")
    cuda.__dict__.update(vars(torch.cuda))
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda device=None: None
    host_torch = types.ModuleType("torch")
    host_torch.__dict__.update(vars(torch))
    host_torch.cuda = cuda
    zeros = torch.zeros

    def host_zeros(*size, device=None, **kw):
        return zeros(*size, device="cpu" if device == "cuda" else device, **kw)

    host_torch.zeros = host_zeros
    saved = schedules.torch, p2p_communication.torch
    schedules.torch = p2p_communication.torch = host_torch
    try:
        yield
    finally:
        schedules.torch, p2p_communication.torch = saved


def _rel_diff(a, b) -> float:
    """max |a - b| / max |a| over two equally shaped tensors (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    scale = a.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale else diff


def _vs_worker(rank, world, args):
    import warnings

    warnings.filterwarnings("ignore", module="megatron")  # optional-accelerator notices at import
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from h3t_training.loop.training import forward_step  # the driver's own step and loss

    import h3t_ext
    from h3t_ext.runtime.config import H3TConfig
    from h3t_ext.runtime.modules.gpt import build_stage_chunks, tiny_llama_config

    n, m = args.iterations, args.num_microbatches
    out = {}
    with megatron_schedules_on_host():
        for v in VS_LAYOUTS:
            vp = v if v > 1 else None
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=vp)
            cfg = tiny_llama_config(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                    ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                                    num_query_groups=args.num_query_groups, pipeline_model_parallel_size=world,
                                    virtual_pipeline_model_parallel_size=vp,
                                    # Megatron-LM's defaults: --overlap-p2p-communication (read by the
                                    # interleaved schedule only) and batch_p2p_comm = not it. Batched transfers
                                    # mix up the two directions at PP=2 with interleaving, where both go to the
                                    # one peer (NVIDIA/Megatron-LM#750).
                                    overlap_p2p_comm=v > 1, batch_p2p_comm=v == 1)
            torch.manual_seed(0)
            model = build_stage_chunks(cfg, vocab_size=VOCAB, max_sequence_length=args.seq_length,
                                       pipeline_rank=rank, ckpt="no", device_type="cpu")
            # the same chunks (so the same weights) for both; megatron's function taken before install()
            funcs = {"megatron": get_forward_backward_func(world, vp)}
            runtime = h3t_ext.install(H3TConfig(ckpt="no", offload_alpha=0.0, device_mode=args.device_mode))
            try:
                funcs["h3t"] = get_forward_backward_func(world, vp)
                assert getattr(funcs["h3t"], "__self__", None) is runtime
            finally:
                h3t_ext.uninstall()
            assert funcs["megatron"] is get_forward_backward_func(world, vp)
            times = {k: [] for k in SCHEDULES}
            cpu = {k: [] for k in SCHEDULES}
            losses = {k: [] for k in SCHEDULES}
            grads = {}
            for it in range(2 * n):  # n warm-up, n timed; AB BA AB ...
                for name in SCHEDULES if it % 2 == 0 else SCHEDULES[::-1]:
                    iters = [_batches(args) for _ in model]
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    store = funcs[name](forward_step_func=forward_step, data_iterator=iters if v > 1 else iters[0],
                                        model=model if v > 1 else model[0], num_microbatches=m,
                                        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                        forward_only=False)
                    c1 = time.process_time()
                    dist.barrier()
                    dt = time.perf_counter() - t0
                    if it >= n:
                        times[name].append(dt)
                        cpu[name].append(c1 - c0)
                    # lm loss is [sum, tokens] per microbatch (the last stage's; empty elsewhere)
                    losses[name].append([d["lm loss"].detach().clone() for d in store])
                    if it == 2 * n - 1 or it == 2 * n - 2:
                        grads[name] = [p.grad.detach().clone() for c in model for p in c.parameters()
                                       if p.grad is not None]
                    for chunk in model:
                        chunk.zero_grad(set_to_none=True)
            loss_rel = 0.0
            for a_it, b_it in zip(losses["megatron"], losses["h3t"]):
                assert len(a_it) == len(b_it) == (m if rank == world - 1 else 0), (len(a_it), len(b_it))
                for a, b in zip(a_it, b_it):
                    loss_rel = max(loss_rel, _rel_diff(a[0] / a[1], b[0] / b[1]))
            assert len(grads["megatron"]) == len(grads["h3t"]) > 0
            grad_rel = max(_rel_diff(a, b) for a, b in zip(grads["megatron"], grads["h3t"]))
            out[v] = {"times": times, "cpu": cpu, "loss_rel_diff": loss_rel, "grad_rel_diff": grad_rel,
                      "losses": len(losses["h3t"][-1])}
            del model, funcs, runtime
    ps.destroy_model_parallel()
    return out


def _vs_megatron(args) -> int:
    from h3t_ext.testing import run_distributed

    p = args.pipeline_model_parallel_size
    t0 = time.perf_counter()
    per_rank = run_distributed(_vs_worker, p, (args,), timeout_s=1800)
    wall = time.perf_counter() - t0
    rows = []
    for v in VS_LAYOUTS:
        # an iteration's step time is its slowest rank's (barrier to barrier); its CPU time the busiest rank's
        step = {k: [max(r[v]["times"][k][i] for r in per_rank) for i in range(args.iterations)] for k in SCHEDULES}
        cpu = {k: [max(r[v]["cpu"][k][i] for r in per_rank) for i in range(args.iterations)] for k in SCHEDULES}
        med = {k: statistics.median(step[k]) for k in SCHEDULES}
        cpu_med = {k: statistics.median(cpu[k]) for k in SCHEDULES}
        rows.append({
            "pipeline_model_parallel_size": p, "virtual_pipeline_model_parallel_size": v,
            "megatron_step_s": round(med["megatron"], 6), "h3t_step_s": round(med["h3t"], 6),
            "ratio": round(med["h3t"] / med["megatron"], 4),
            # the same round's two runs ran back to back: the median of their ratios is the least drift-prone
            "paired_ratio": round(statistics.median(h / m for h, m in zip(step["h3t"], step["megatron"])), 4),
            "megatron_cpu_s": round(cpu_med["megatron"], 6), "h3t_cpu_s": round(cpu_med["h3t"], 6),
            "cpu_ratio": round(cpu_med["h3t"] / cpu_med["megatron"], 4),
            "megatron_step_s_all": [round(t, 6) for t in step["megatron"]],
            "h3t_step_s_all": [round(t, 6) for t in step["h3t"]],
            "losses_compared": per_rank[-1][v]["losses"],
            "max_loss_rel_diff": max(r[v]["loss_rel_diff"] for r in per_rank),
            "max_grad_rel_diff": max(r[v]["grad_rel_diff"] for r in per_rank),
        })
    info = {"num_layers": args.num_layers, "hidden_size": args.hidden_size, "seq_length": args.seq_length,
            "micro_batch_size": args.micro_batch_size, "num_microbatches": args.num_microbatches,
            "iterations": args.iterations, "warmup_iterations": args.iterations, "ckpt": "no",
            "offload_alpha": 0.0, "device_mode": args.device_mode, "wall_s": round(wall, 1)}
    if args.json:
        print(json.dumps({"config": info, "layouts": rows}, indent=1))
        return 0
    print(f"h3t-ext executor vs megatron-core schedules: PP={p} L={args.num_layers} h={args.hidden_size} "
          f"s={args.seq_length} b={args.micro_batch_size} m={args.num_microbatches} ckpt=no alpha=0, "
          f"{args.iterations} warm-up + {args.iterations} timed iterations each, alternating; {wall:.0f} s")
    print(f"{'layout':15s} {'megatron s':>10s} {'h3t s':>8s} {'ratio':>6s} {'paired':>6s} {'cpu ratio':>9s} "
          f"{'loss rel diff':>13s} {'grad rel diff':>13s}")
    for r in rows:
        v = r["virtual_pipeline_model_parallel_size"]
        name = "1F1B v=1" if v == 1 else f"interleaved v={v}"
        print(f"{name:15s} {r['megatron_step_s']:10.4f} {r['h3t_step_s']:8.4f} {r['ratio']:6.3f} "
              f"{r['paired_ratio']:6.3f} {r['cpu_ratio']:9.3f} {r['max_loss_rel_diff']:13.3g} "
              f"{r['max_grad_rel_diff']:13.3g}")
    print("step s: median over the timed iterations of the slowest rank's time; ratio: h3t / megatron of those "
          "medians; paired: median of the per-round ratios; cpu ratio: the same for the busiest rank's CPU time")
    return 0


def main(argv=None) -> int:
    args = _parse(argv)
    if args.vs_megatron:
        return _vs_megatron(args)
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
