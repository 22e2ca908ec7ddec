#!/usr/bin/env python3
"""Per-stage peak memory of a two-stage interleaved pipeline against the cost model (stage_memory).

Two gloo ranks share one GPU (NCCL refuses two ranks on one device), their pipeline transfers
staged through host memory (``H3TConfig.p2p_staging="host"``). They train a Llama-style GPTModel
(RMSNorm, SwiGLU, RoPE, untied embeddings, megatron-core's 'local' layers with SDPA attention, bf16)
with pipeline 2, virtual size 2, ckpt=ours (or --ckpt no) and offload alpha 0.5, wrapped in megatron-core's DDP
(fp32 gradient buffer) with megatron-core's mixed-precision Adam (fp32 master weights, not
distributed). After warm-up iterations (the first one creates the Adam states) every rank records
``torch.cuda.max_memory_allocated`` over the measured iterations (forward-backward and optimizer
step separately) and compares the larger with
``stage_memory(spec, plan, stage, 0.5).peak_bytes`` of a ModelSpec/Plan describing exactly this run
(t = c = d = 1, no sequence parallelism, transformer_impl 'local', no distributed optimizer).

``--device cpu`` runs the same pipeline on the CPU in float32 (host staging on; the copies are
counted). The allocator's peak is not measurable there: what is compared is each stage's peak of
saved activation bytes held by the activation manager against ``stage_activation_peak_bytes``
(fp32, 'local', no sequence parallelism), as tests/integration/test_memory_prediction.py does.

    python scripts/gpu/stage_memory.py [--device cuda|cpu] [--json]

``--json`` prints one JSON object as the last line: ``device``, ``measure``, ``stages`` (per stage
``measured_bytes``, ``predicted_bytes``, ``rel_error``, the host copies of the last iteration under
``staging`` and diagnostics: parameters held and predicted, the activation manager's peak and its
prediction, on a GPU the forward-backward and optimizer-step peaks, the persistent bytes, the cuBLAS
workspace and the predicted terms), ``max_error``, ``losses``, the model, plan and run settings.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PP, V, ALPHA = 2, 2, 0.5
CKPTS = ("ours", "no")
"""--ckpt (default ours): ckpt=no keeps the norms' and the MLP's saved tensors to those of fused kernels
(h3t_ext.runtime.modules.fused_saves), which the cost model counts."""
SIZES = {  # per device: large enough on a GPU that activations and weights dwarf allocator noise
    "cuda": dict(num_layers=8, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=8, vocab_size=8192,
                 seq_length=2048, micro_batch_size=2, num_microbatches=8, warmup=2, iterations=3),
    "cpu": dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=256,
                seq_length=32, micro_batch_size=2, num_microbatches=4, warmup=1, iterations=1),
}


def _parse(argv):
    from h3t_training.config.arguments import OneLineParser

    ap = OneLineParser(prog="stage_memory.py", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--ckpt", choices=CKPTS, default="ours")
    for name in SIZES["cuda"]:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                        help=f"default {SIZES['cuda'][name]} on cuda, {SIZES['cpu'][name]} on cpu")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit for the whole two-rank run")
    args = ap.parse_args(argv)
    for name, default in SIZES[args.device].items():
        value = getattr(args, name)
        if value is None:
            setattr(args, name, default)
        elif value < (0 if name == "warmup" else 1):
            ap.error(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}, got {value}")
    if args.num_layers % (PP * V):
        ap.error(f"--num-layers must be divisible by pipeline 2 x virtual 2 = 4, got {args.num_layers}")
    if args.hidden_size % args.num_attention_heads:
        ap.error("--hidden-size must be divisible by --num-attention-heads")
    if args.vocab_size % 128:
        ap.error(f"--vocab-size must be a multiple of 128 (the cost model pads to it), got {args.vocab_size}")
    return args


def _optimizer_impl(args) -> str:
    """megatron-core's Adam on a GPU (torch's AdamW without TE and apex); the CPU comparison has no optimizer step."""
    if args.device != "cuda":
        return "fused"
    from h3t_training.config.megatron_fields import optimizer_impl

    return optimizer_impl()


def spec_and_plan(args):
    """The cost model's description of exactly this run."""
    from h3t_ext.costmodel import ModelSpec, Plan

    spec = ModelSpec("stage-memory", args.num_layers, args.hidden_size, args.num_attention_heads,
                     args.num_attention_heads, args.ffn_hidden_size, args.vocab_size, swiglu=True,
                     untie_embeddings_and_output_weights=True)
    plan = Plan(num_gpus=PP, seq_length=args.seq_length,
                global_batch_size=args.num_microbatches * args.micro_batch_size, micro_batch_size=args.micro_batch_size,
                pipeline_model_parallel_size=PP,
                num_layers_per_virtual_pipeline_stage=args.num_layers // (PP * V), ckpt=args.ckpt, offload_alpha=ALPHA,
                sequence_parallel=False, use_distributed_optimizer=False, transformer_impl="local",
                optimizer_impl=_optimizer_impl(args))
    return spec, plan


def _batches(args, device, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    b, s = args.micro_batch_size, args.seq_length
    out = []
    for _ in range(args.num_microbatches):
        tok = torch.randint(0, args.vocab_size, (b, s + 1), generator=g)
        out.append({"tokens": tok[:, :-1].contiguous().to(device), "labels": tok[:, 1:].contiguous().to(device),
                    "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous().to(device)})
    return out


def _build(args, rank: int, on_gpu: bool):
    """(model chunks as run, step function, zero-grad function)."""
    import torch
    from megatron.core import parallel_state as ps

    from h3t_ext.runtime.modules.gpt import build_stage_chunks, tiny_llama_config

    ps.initialize_model_parallel(pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=V)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    cfg = tiny_llama_config(num_layers=args.num_layers, hidden_size=args.hidden_size,
                            ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                            num_query_groups=args.num_attention_heads, pipeline_model_parallel_size=PP,
                            virtual_pipeline_model_parallel_size=V, params_dtype=dtype, pipeline_dtype=dtype,
                            bf16=on_gpu)
    torch.manual_seed(0)
    if on_gpu:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)
    chunks = build_stage_chunks(cfg, vocab_size=args.vocab_size, max_sequence_length=args.seq_length,
                                pipeline_rank=rank, ckpt=args.ckpt, backend="local",
                                device_type="cuda" if on_gpu else "cpu")
    if not on_gpu:
        adam = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-4)
        return chunks, adam.step, lambda: adam.zero_grad(set_to_none=True)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunks = [c.cuda() for c in chunks]
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
    wrapped = [DistributedDataParallel(config=cfg, ddp_config=ddp, module=c, disable_bucketing=i > 0)
               for i, c in enumerate(chunks)]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, params_dtype=dtype,
                                                 clip_grad=1.0, use_distributed_optimizer=False), wrapped)

    def zero_grad():
        for w in wrapped:
            w.zero_grad_buffer()
        opt.zero_grad()

    # Data parallel size 1 and untied embeddings: no gradient needs a collective before the step (the
    # DDP buffer holds the summed fp32 gradients); the step's gradient-norm all-reduce runs on gloo.
    return wrapped, opt.step, zero_grad


def _worker(rank, world, args):
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from h3t_ext.runtime.memory.activations import ActivationManager
    from h3t_ext.runtime.config import H3TConfig
    from h3t_ext.runtime.memory.device import make_device_layer
    from h3t_ext.runtime.modules.gpt import mean_loss_forward_step
    from h3t_ext.runtime.pipeline.schedules import H3TSchedules

    on_gpu = args.device == "cuda"
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    cublas = 0
    if on_gpu:
        torch.cuda.set_device(device)
        x = torch.ones(256, 256, device=device, dtype=torch.bfloat16)
        (x @ x).sum().item()  # the cuBLAS workspace comes from the caching allocator
        del x
        cublas = torch.cuda.memory_allocated()
    model, step, zero_grad = _build(args, rank, on_gpu)

    def counting_factory(cfg, pp_rank, pp_size, dev):  # every saved tensor managed, as the cost model prices
        return ActivationManager(cfg.stage_alpha(pp_rank, pp_size), make_device_layer(cfg.device_mode, dev),
                                 min_offload_bytes=0)

    sched = H3TSchedules(H3TConfig(ckpt=args.ckpt, offload_alpha=ALPHA, p2p_staging="host"),
                         manager_factory=None if on_gpu else counting_factory)
    batches = _batches(args, device, seed=7)
    fb_peaks, step_peaks, losses = [], [], []
    persistent = 0
    for it in range(args.warmup + args.iterations):
        measuring = it >= args.warmup
        zero_grad()
        if on_gpu:
            torch.cuda.synchronize()
            persistent = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        store = sched.forward_backward_pipelining_with_interleaving(
            forward_step_func=mean_loss_forward_step, data_iterator=[iter(batches) for _ in model], model=model,
            num_microbatches=args.num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False)
        if on_gpu:
            torch.cuda.synchronize()
            fb_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        step()
        if on_gpu:
            torch.cuda.synchronize()
            if measuring:
                fb_peaks.append(fb_peak)
                step_peaks.append(torch.cuda.max_memory_allocated())
        losses.append([float(d["lm loss"]) for d in store])
    (mgr,) = [m for m in sched.preparer.managers if m is not None]
    stats = sched.last_staging
    return {"params": sum(p.numel() for chunk in model for p in chunk.parameters()),
            "fb_peak": max(fb_peaks, default=None), "step_peak": max(step_peaks, default=None),
            "persistent_bytes": persistent if on_gpu else None, "cublas_workspace_bytes": cublas if on_gpu else None,
            "activation_peak_bytes": mgr.stats.peak_resident_bytes, "losses": losses,
            "staging": {"sends": stats.sends, "recvs": stats.recvs, "bytes": stats.bytes}}


def compare(args, per_rank: list) -> dict:
    """Measured against predicted per stage, and the largest relative error."""
    from h3t_ext.costmodel import stage_activation_peak_bytes, stage_memory, stage_params
    from h3t_ext.dtypes import BF16, FP32

    spec, plan = spec_and_plan(args)
    on_gpu = args.device == "cuda"
    act_pred = stage_activation_peak_bytes(spec, plan, dtype_bytes=BF16 if on_gpu else FP32, layer_spec="local",
                                           sequence_parallel=False)
    stages = []
    for stage, r in enumerate(per_rank):
        row = {"stage": stage, "params": r["params"], "predicted_params": stage_params(spec, plan, stage),
               "activation_peak_bytes": r["activation_peak_bytes"],
               "predicted_activation_peak_bytes": act_pred[stage], "staging": r["staging"]}
        if on_gpu:
            mem = stage_memory(spec, plan, stage, ALPHA)
            fixed = sum(mem.terms[k] for k in ("weights", "grads", "optimizer_states"))
            measured, predicted = max(r["fb_peak"], r["step_peak"]), mem.peak_bytes
            row.update(fwd_bwd_peak_bytes=r["fb_peak"], optimizer_step_peak_bytes=r["step_peak"],
                       persistent_bytes=r["persistent_bytes"], predicted_persistent_bytes=fixed,
                       cublas_workspace_bytes=r["cublas_workspace_bytes"], predicted_terms=dict(mem.terms),
                       # the cost model has no term for cuBLAS's workspace (from the caching allocator)
                       rel_error_without_cublas_workspace=round(
                           (measured - r["cublas_workspace_bytes"] - predicted) / predicted, 5))
        else:
            measured, predicted = r["activation_peak_bytes"], act_pred[stage]
        row.update(measured_bytes=measured, predicted_bytes=predicted,
                   rel_error=round((measured - predicted) / predicted, 5))
        stages.append(row)
    measure = ("torch.cuda.max_memory_allocated vs stage_memory(...).peak_bytes" if on_gpu else
               "saved-activation peak (ActivationManager) vs stage_activation_peak_bytes (fp32); "
               "max_memory_allocated is not measurable on CPU")
    return {"device": args.device, "measure": measure, "max_error": max(abs(s["rel_error"]) for s in stages),
            "stages": stages, "losses": per_rank[-1]["losses"],
            "model": spec.__dict__, "plan": dataclasses.asdict(plan),
            "run": {"pipeline_model_parallel_size": PP, "virtual_pipeline_model_parallel_size": V, "ckpt": args.ckpt,
                    "offload_alpha": ALPHA, "p2p_staging": "host", "dtype": "bf16" if on_gpu else "fp32",
                    "warmup": args.warmup, "iterations": args.iterations}}


def failing_ranks_line(report: str) -> str:
    """'rank R: <its last line>' for each rank in run_distributed's report, joined in one line (the lowest rank's
    error is usually the cause; a peer's is 'the peer process is gone')."""
    parts = []
    for section in report.split("--- rank ")[1:]:
        head, _, body = section.partition(" ---")
        lines = [ln.strip() for ln in body.strip().splitlines() if ln.strip()]
        parts.append(f"rank {head.strip()}: {lines[-1] if lines else 'failed'}")
    if parts:
        return "; ".join(parts)
    lines = [ln.strip() for ln in report.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "a rank failed"


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    from h3t_ext.testing import DistributedTestError, run_distributed

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("stage_memory.py: error: no CUDA device (use --device cpu for the CPU run)\n")
        return 1
    try:
        per_rank = run_distributed(_worker, PP, (args,), timeout_s=args.timeout_s)
    except DistributedTestError as exc:  # one line: each failing rank's last line (its exception), rank 0 first
        sys.stderr.write(f"stage_memory.py: error: {failing_ranks_line(str(exc))}\n")
        return 1
    result = compare(args, per_rank)
    if not args.json:
        print(f"{result['measure']} ({args.device}, pipeline 2, v=2, ckpt={args.ckpt}, alpha {ALPHA}, host-staged P2P)")
        for s in result["stages"]:
            print(f"  stage {s['stage']}: measured {s['measured_bytes'] / 2**20:10.1f} MiB, predicted "
                  f"{s['predicted_bytes'] / 2**20:10.1f} MiB, error {100 * s['rel_error']:+.2f}%")
        print(f"  max error {100 * result['max_error']:.2f}%")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
