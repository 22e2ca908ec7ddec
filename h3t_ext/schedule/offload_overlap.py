"""Where an activation offload can hide behind compute: the one rule the runtime checks before it runs a schedule and
the cost model before it prices a plan (pure; no torch).

With a pipeline, a microbatch-chunk is offloaded whole, and only where its rank's action list has two compute actions
between its forward and its backward (the builder emits OFFLOAD/RELOAD for exactly those, :meth:`PipelineSchedule.
offloaded`): the first hides the copy out, the second the copy back. At pipeline size 1 the offload is layer-granular:
a layer's saved activations go out behind the next layer's forward, so a model chunk needs two layers. An alpha > 0
where no such place exists would move nothing: accepted, it would change neither memory nor time, so it is refused.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

from h3t_ext.schedule.builder import PipelineSchedule


def schedule_can_offload(schedule: PipelineSchedule) -> tuple[bool, ...]:
    """Per pipeline rank, whether ``schedule``'s list carries an offload (built with the alphas it runs)."""
    return tuple(bool(schedule.offloaded(r)) for r in range(schedule.config.pipeline_model_parallel_size))


def overlap_refusal(offload_alpha: Union[float, Sequence[float]], can: Sequence[bool], *,
                    pipeline_model_parallel_size: int, virtual_pipeline_model_parallel_size: int,
                    num_microbatches: int, layer_granular: bool,
                    num_layers_per_chunk: Optional[int] = None) -> Optional[str]:
    """Why ``offload_alpha`` (one value, or one per pipeline rank) cannot be overlapped where ``can`` says which ranks
    have a place for it (:func:`schedule_can_offload` of the lists a runtime runs; the cost model's closed form of
    them), or None. One value is refused where no rank can use it; one per rank where a rank with a value > 0
    cannot."""
    uniform = isinstance(offload_alpha, (int, float))
    alphas = [float(offload_alpha)] * len(can) if uniform else [float(a) for a in offload_alpha]
    if not any(a > 0 for a in alphas):
        return None
    text = f"{offload_alpha}" if uniform else ",".join(f"{a}" for a in alphas)
    shape = (f"--pipeline-model-parallel-size {pipeline_model_parallel_size}, {virtual_pipeline_model_parallel_size} "
             f"model chunk(s), {num_microbatches} microbatch(es)")
    if layer_granular and not any(can):
        return (f"--offload-alpha {text} cannot be overlapped: at --pipeline-model-parallel-size 1 a layer's offload "
                f"hides behind the next layer's forward, and a model chunk has {num_layers_per_chunk} layer(s); use "
                "--offload-alpha 0 or at least 2 layers")
    if uniform:
        if not any(can):
            return (f"--offload-alpha {text} cannot be overlapped: with {shape} no microbatch has two compute steps "
                    "between its forward and backward; use --offload-alpha 0")
        return None
    bad = [r for r, (a, ok) in enumerate(zip(alphas, can)) if a > 0 and not ok]
    if bad:
        return (f"--offload-alpha is > 0 on pipeline stage(s) {bad} that cannot overlap an offload with {shape}; set "
                "those stages to 0")
    return None


__all__ = ["overlap_refusal", "schedule_can_offload"]
