"""Megatron-style iteration logs, a progress bar on a terminal, and the ``--metrics-json`` file.

MFU follows the published convention, the cost model's one formula
(:func:`h3t_ext.costmodel.mfu.model_flops_per_token`: tokens/s/GPU x 3 x [2L(2h^2 + 2h h_kv + k hf) + 2shL +
2Vh] / peak, k = 3 for SwiGLU and 2 for GeLU, causal attention counted as half of s^2). The peak is the cost model's bf16 peak of the
GPU system on CUDA; on CPU there is no such number, so MFU is relative to the dense float32 GEMM
throughput measured once at start-up (printed with the run's first line).
"""
from __future__ import annotations

import json
import math
import os
import resource
import time
from typing import Optional

import torch

from h3t_training.data.batch_schedule import schedule_of
from h3t_training.config.run_spec import model_flops_per_iteration_token


SPLIT_FIELDS = ("num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split", "pipeline_model_parallel_layout",
                "microbatch_group_size_per_vp_stage")
"""The layer split's flags and the interleaved schedule's microbatch group size, written into ``--metrics-json``'s
config so that ``h3t-plan calibrate`` prices the split and schedule the run trained with
(:mod:`h3t_ext.planner.calibrate`)."""

def measured_cpu_peak_flops(n: int = 384, trials: int = 12) -> float:
    """Best dense fp32 GEMM FLOP/s of this process over a few short trials (the CPU stand-in for a peak)."""
    g = torch.Generator().manual_seed(0)  # its own generator: the run's RNG streams are not touched
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    torch.mm(a, b)
    best = 0.0
    for _ in range(trials):
        t0 = time.perf_counter()
        torch.mm(a, b)
        torch.mm(a, b)
        best = max(best, 4 * n ** 3 / (time.perf_counter() - t0))
    return best


def peak_flops(args, on_gpu: bool) -> tuple[float, str]:
    """(peak FLOP/s per device, what it is) for MFU."""
    if on_gpu:
        from h3t_ext.costmodel import get_system
        from h3t_training.config.auto_plan import system_name
        s = get_system(system_name(args))
        return s.peak_bf16_flops, f"{s.name} bf16 peak"
    return measured_cpu_peak_flops(), "measured CPU fp32 GEMM throughput"


def max_memory_mb(on_gpu: bool) -> float:
    """Peak device memory allocated (GPU) or peak resident set size (CPU), in MB."""
    if on_gpu:
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class IterationLogger:
    """Logs on the last rank every ``--log-interval`` iterations and keeps the per-iteration metrics."""

    def __init__(self, args, *, vocab_size: int, on_gpu: bool, is_logging_rank: bool, progress_bar: bool = False):
        self.args, self.on_gpu, self.enabled = args, on_gpu, is_logging_rank
        self.flops_per_token = model_flops_per_iteration_token(args, vocab_size)  # forward + backward
        self.peak, self.peak_what = peak_flops(args, on_gpu) if is_logging_rank else (1.0, "")
        self.records: list[dict] = []
        self._interval: list[dict] = []  # the records since the last log line (Megatron averages over them)
        self.skipped_samples = 0
        """The samples ``--iterations-to-skip`` read past (Megatron-LM's ``skipped_train_samples``, a checkpoint's
        count at the start): the log line shows it once above zero, and checkpoints keep it."""
        self.progress = None
        if is_logging_rank and progress_bar:  # a rich bar on a watched terminal (the entry point decides)
            from rich.progress import Progress
            self.progress = Progress(transient=True)
            self.task = self.progress.add_task("training", total=args.train_iters)
            self.progress.start()

    def header(self, start_iteration: int, num_params: int) -> None:
        if self.enabled:
            self._print(f"training: {self.args.train_iters} iterations from {start_iteration}, world size "
                        f"{self.args.world_size}, {num_params} parameters on this rank, MFU relative to "
                        f"{self.peak_what} ({self.peak / 1e12:.3f} TFLOP/s)")

    def _print(self, line: str) -> None:
        if self.progress is not None:
            self.progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, flush=True)

    def record(self, iteration: int, loss: float, elapsed_s: float, lr: float, grad_norm: Optional[float], *,
               loss_scale: float = 1.0, skipped: bool = False, num_zeros: Optional[float] = None,
               params_norm: Optional[float] = None) -> dict:
        """Store one iteration's metrics (1-based iteration) and print the log line when due; ``num_zeros`` and
        ``params_norm`` with --log-num-zeros-in-grad and --log-params-norm (else None)."""
        a = self.args
        batch = schedule_of(a).batch_size(iteration - 1)
        tps_gpu = batch * a.seq_length / elapsed_s / a.world_size
        tflops = self.flops_per_token * tps_gpu / 1e12
        rec = {"iteration": iteration, "loss": loss, "global_batch_size": batch, "tokens_per_second_per_gpu": tps_gpu,
               "mfu": tflops * 1e12 / self.peak, "tflops_per_gpu": tflops, "elapsed_ms": elapsed_s * 1e3,
               "learning_rate": lr, "grad_norm": grad_norm, "loss_scale": loss_scale, "skipped": skipped,
               "num_zeros_in_grad": num_zeros, "params_norm": params_norm,
               "skipped_train_samples": self.skipped_samples}
        self.records.append(rec)
        self._interval.append(rec)
        if not self.enabled:
            return rec
        if self.progress is not None:
            self.progress.update(self.task, completed=iteration, description=f"loss {loss:.4f}")
        first = len(self.records) == 1  # the first iteration of this run (a resumed run's too)
        if iteration % a.log_interval == 0 or first:
            self._print(self._line(iteration, lr, grad_norm, reset=not first))
        return rec

    def _line(self, iteration: int, lr: float, grad_norm: Optional[float], *, reset: bool = True) -> str:
        """Megatron's log line: time, throughput and loss averaged over the iterations since the last interval's
        line; learning rate, grad norm and loss scale of this iteration (1.0 without fp16 loss scaling); the counts of
        skipped (fp16 overflow) and non-finite iterations in the interval. Megatron-LM (0.19) also prints the run's
        first iteration, without starting a new interval (``reset=False``): the next line still averages from it."""
        a, recs = self.args, self._interval
        if reset:
            self._interval = []
        n = len(recs)
        elapsed_ms = sum(r["elapsed_ms"] for r in recs) / n
        tokens = sum(r["global_batch_size"] for r in recs) * a.seq_length
        tps_gpu = tokens / (sum(r["elapsed_ms"] for r in recs) / 1e3) / a.world_size
        tflops = self.flops_per_token * tps_gpu / 1e12
        finite = [r["loss"] for r in recs if math.isfinite(r["loss"])]
        loss = sum(finite) / len(finite) if finite else float("nan")
        skipped = sum(1 for r in recs if r["skipped"])
        nan = sum(1 for r in recs if not math.isfinite(r["loss"])
                  or (r["grad_norm"] is not None and not math.isfinite(r["grad_norm"])))
        norm = "" if grad_norm is None else f" grad norm: {grad_norm:.3f} |"
        last = recs[-1]  # Megatron prints these two of the logged iteration, after the grad norm
        if last["num_zeros_in_grad"] is not None:
            norm += f" num zeros: {last['num_zeros_in_grad']} |"
        if last["params_norm"] is not None:
            norm += f" params norm: {last['params_norm']:.3f} |"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        read_past = last["skipped_train_samples"]
        skipped_samples = f" skipped samples: {read_past:12d} |" if read_past > 0 else ""
        return (f" [{stamp}] iteration {iteration:8d}/{a.train_iters:8d} | consumed samples: "
                f"{schedule_of(a).consumed_samples(iteration):12d} |{skipped_samples} elapsed time per iteration (ms): "
                f"{elapsed_ms:.1f} | "
                f"throughput per GPU (TFLOP/s/GPU): {tflops:.4f} | tokens per second per GPU: {tps_gpu:.1f} | "
                f"MFU: {100 * tflops * 1e12 / self.peak:.2f}% | learning rate: {lr:.6E} | global batch size: "
                f"{recs[-1]['global_batch_size']:5d} | lm loss: {loss:.6E} | loss scale: {recs[-1]['loss_scale']:.1f} |{norm} "
                f"number of skipped iterations: {skipped:3d} | number of nan iterations: {nan:3d} | max memory (MB): "
                f"{max_memory_mb(self.on_gpu):.1f} |")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _strict(x):
    """Strict JSON: a non-finite number (a loss not known on this stage, a diverged run) is null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def write_metrics_json(path: str, args, records: list[dict], stage_stats: list[dict],
                       evaluations: Optional[list[dict]] = None, state_bytes: Optional[list[dict]] = None) -> None:
    """The ``--metrics-json`` object (written by the last rank); ``evaluations`` holds one
    ``{iteration, split, loss, ppl, at_end}`` per evaluation (split ``valid`` or ``test``); ``state_bytes``
    one ``{rank, pipeline_rank, tensor_rank, context_rank, data_parallel_rank, device: {params, grads,
    optimizer}, host: {...}}`` per global rank (:mod:`h3t_training.telemetry.state_bytes`)."""
    out = {
        "iterations": records,
        "evaluations": list(evaluations or []),
        "state_bytes": list(state_bytes or []),
        "stage_peak_activation_bytes": [s.get("peak_activation_bytes") for s in stage_stats],
        "offloaded_bytes": [s.get("offloaded_bytes") for s in stage_stats],
        "stage_layer_numbers": [s.get("layer_numbers") for s in stage_stats],
        "config": {"ckpt": args.ckpt, "offload_alpha": args.offload_alpha, "world_size": args.world_size,
                   "tensor_model_parallel_size": args.tensor_model_parallel_size,
                   "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
                   "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size,
                   **{k: getattr(args, k) for k in SPLIT_FIELDS},
                   "context_parallel_size": args.context_parallel_size,
                   "data_parallel_size": args.data_parallel_size, "micro_batch_size": args.micro_batch_size,
                   "use_distributed_optimizer": args.use_distributed_optimizer,
                   "optimizer_cpu_offload": args.optimizer_cpu_offload,
                   "optimizer_offload_fraction": args.optimizer_offload_fraction,
                   "global_batch_size": args.global_batch_size, "seq_length": args.seq_length,
                   "auto_plan_flags": args.auto_plan_flags},
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_strict(out), f, indent=1, allow_nan=False)
    os.replace(tmp, path)
