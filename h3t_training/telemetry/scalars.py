"""What the driver writes to TensorBoard / wandb: Megatron-LM's tags plus h3t-ext's per-stage ones.

Megatron's tags and switches (``training_log`` and ``evaluate_and_print_results`` in Megatron-LM's
``training.py``): every ``--tensorboard-log-interval`` iterations ``learning-rate`` (unless
``--no-log-learnig-rate-to-tensorboard``), ``batch-size`` (``--log-batch-size-to-tensorboard``),
``lm loss``, ``loss-scale`` (unless ``--no-log-loss-scale-to-tensorboard``), ``world-size``
(``--log-world-size-to-tensorboard``), ``grad-norm``, memory (``--log-memory-to-tensorboard``:
``mem-reserved-bytes``, ``mem-allocated-bytes``, ``mem-max-allocated-bytes`` on CUDA; on CPU
``mem-max-rss-bytes``, the peak resident set size, since CPU tensors have no allocator statistics),
each also as ``<tag> vs samples`` over consumed samples; every ``--log-interval`` iterations
``iteration-time`` (seconds, ``--log-timers-to-tensorboard``) and ``throughput`` (TFLOP/s/GPU,
``--log-throughput``). Evaluations write ``lm loss validation`` / ``lm loss test`` (+ ``vs samples``,
+ `` ppl`` with ``--log-validation-ppl-to-tensorboard``); like Megatron, ``--skip-train`` runs write
no evaluation scalars.

h3t-ext's own, every ``--tensorboard-log-interval`` iterations: ``h3t/peak-activation-bytes/stage-R``,
``h3t/offloaded-bytes/stage-R`` (the stage's saved activations over that iteration) and
``h3t/offload-alpha/stage-R``, plus ``h3t/tokens-per-second-per-gpu``, ``h3t/mfu`` and the cost
model's predictions for the run's plan (``h3t/predicted-...``, see ``h3t_training.telemetry.prediction``).
"""
from __future__ import annotations

import resource

import torch

from h3t_training.data.batch_schedule import schedule_of


class TrainingScalars:
    """Turns the driver's per-iteration records, stage statistics and evaluations into scalars."""

    def __init__(self, args, writer, *, on_gpu: bool, predicted: dict | None = None):
        self.args, self.writer, self.on_gpu = args, writer, on_gpu
        self.predicted = dict(predicted or {})

    def _pair(self, tag: str, value: float, iteration: int) -> None:
        self.writer.add_scalar(tag, value, iteration)
        self.writer.add_scalar(tag + " vs samples", value, schedule_of(self.args).consumed_samples(iteration))

    def tensorboard_due(self, iteration: int) -> bool:
        return iteration % self.args.tensorboard_log_interval == 0

    def iteration(self, rec: dict, *, loss_scale: float) -> None:
        """One training iteration's scalars (``rec`` is the IterationLogger record, 1-based iteration)."""
        a, it = self.args, rec["iteration"]
        if self.tensorboard_due(it):
            if a.log_learning_rate_to_tensorboard:
                self._pair("learning-rate", rec["learning_rate"], it)
            if rec.get("skipped_train_samples", 0) > 0:  # Megatron-LM writes it alone (no "vs samples" twin)
                self.writer.add_scalar("skipped-train-samples", rec["skipped_train_samples"], it)
            if a.log_batch_size_to_tensorboard:
                self._pair("batch-size", rec.get("global_batch_size", a.global_batch_size), it)
            self._pair("lm loss", rec["loss"], it)
            if a.log_loss_scale_to_tensorboard:
                self._pair("loss-scale", loss_scale, it)
            if a.log_world_size_to_tensorboard:
                self._pair("world-size", a.world_size, it)
            if rec["grad_norm"] is not None:
                self._pair("grad-norm", rec["grad_norm"], it)
            for key, tag in (("num_zeros_in_grad", "num-zeros"), ("params_norm", "params-norm")):
                if rec.get(key) is not None:
                    self._pair(tag, rec[key], it)
            if a.log_memory_to_tensorboard:
                for tag, value in self._memory().items():
                    self.writer.add_scalar(tag, value, it)
            self.writer.add_scalar("h3t/tokens-per-second-per-gpu", rec["tokens_per_second_per_gpu"], it)
            self.writer.add_scalar("h3t/mfu", rec["mfu"], it)
            for tag, value in self.predicted.items():
                self.writer.add_scalar(tag, value, it)
        if it % a.log_interval == 0:
            if a.log_timers_to_tensorboard:
                self.writer.add_scalar("iteration-time", rec["elapsed_ms"] / 1e3, it)
            if a.log_throughput:
                self.writer.add_scalar("throughput", rec["tflops_per_gpu"], it)

    def _memory(self) -> dict:
        if self.on_gpu:
            s = torch.cuda.memory_stats()
            return {"mem-reserved-bytes": s["reserved_bytes.all.current"],
                    "mem-allocated-bytes": s["allocated_bytes.all.current"],
                    "mem-max-allocated-bytes": s["allocated_bytes.all.peak"]}
        return {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def stages(self, iteration: int, stage_stats: list[dict], alphas: list[float]) -> None:
        """Per-stage activation statistics (gathered from every stage) and the stage's offload ratio."""
        for s, alpha in zip(stage_stats, alphas):
            r = s["pipeline_rank"]
            self.writer.add_scalar(f"h3t/peak-activation-bytes/stage-{r}", s["peak_activation_bytes"], iteration)
            self.writer.add_scalar(f"h3t/offloaded-bytes/stage-{r}", s["offloaded_bytes"], iteration)
            self.writer.add_scalar(f"h3t/offload-alpha/stage-{r}", alpha, iteration)

    def evaluation(self, iteration: int, split: str, loss: float, ppl: float) -> None:
        """``lm loss validation`` / ``lm loss test`` at ``iteration`` (Megatron's tag names)."""
        key = "lm loss " + ("validation" if split == "valid" else "test")
        self._pair(key, loss, iteration)
        if self.args.log_validation_ppl_to_tensorboard:
            self._pair(key + " ppl", ppl, iteration)
