"""The cost model's prediction for the plan being run, written next to the measured scalars.

``h3t/predicted-peak-activation-bytes/stage-R`` is ``h3t_ext.costmodel``'s saved-activation peak
of each pipeline stage for this run's layout, ckpt and alphas, in the run's own terms (fp32 and
megatron-core's local layer spec on CPU; bf16 and TransformerEngine's spec on a GPU with
``--bf16`` and TransformerEngine), so it compares with the measured
``h3t/peak-activation-bytes/stage-R``. The step time and device memory are predicted for a GPU
system: on a GPU they are ``h3t/predicted-step-time`` (seconds, next to ``iteration-time``) and
``h3t/predicted-peak-memory-bytes`` (next to ``mem-max-allocated-bytes``); on CPU the GPU time
is not comparable with what is measured, so it is written only as
``h3t/predicted-step-time-on-<system>`` (seconds on that GPU system, ``--gpu`` or the default).
"""
from __future__ import annotations


def _has_te() -> bool:
    import importlib.util
    return importlib.util.find_spec("transformer_engine") is not None


def predicted_scalars(args, *, vocab_size: int, on_gpu: bool) -> dict[str, float]:
    """Tag -> predicted value for this run's plan; tags the cost model cannot price are left out."""
    from h3t_ext.costmodel import Plan, get_system
    from h3t_ext.costmodel.activations import BOOL, stage_activation_peak_bytes
    from h3t_ext.costmodel.errors import PlanError, UnknownNameError
    from h3t_ext.costmodel.estimate import estimate
    from h3t_training.auto_plan import model_spec, system_name

    model = model_spec(args, vocab_size, name="run")
    alpha = args.offload_alpha if isinstance(args.offload_alpha, float) else tuple(args.offload_alpha)
    plan = Plan(num_gpus=args.world_size, seq_length=args.seq_length, global_batch_size=args.global_batch_size,
                micro_batch_size=args.micro_batch_size, tensor_model_parallel_size=args.tensor_model_parallel_size,
                context_parallel_size=args.context_parallel_size,
                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage, ckpt=args.ckpt,
                offload_alpha=alpha)
    out: dict[str, float] = {}
    te = on_gpu and _has_te()
    try:
        dtype_bytes = 2 if (on_gpu and args.bf16) else 4
        acts = stage_activation_peak_bytes(model, plan, dtype_bytes=dtype_bytes, layer_spec="te" if te else "local",
                                           sequence_parallel=args.sequence_parallel,
                                           dropout_mask_bytes=BOOL if on_gpu else dtype_bytes)
        for r, b in enumerate(acts):
            out[f"h3t/predicted-peak-activation-bytes/stage-{r}"] = float(b)
    except (PlanError, ValueError):
        pass
    try:
        system = get_system(system_name(args))
        est = estimate(model, plan, system)
    except (PlanError, UnknownNameError, ValueError):
        return out
    if on_gpu:
        out["h3t/predicted-step-time"] = est.iteration_time_s
        out["h3t/predicted-peak-memory-bytes"] = float(est.peak_memory_bytes)
    else:
        out[f"h3t/predicted-step-time-on-{system.name}"] = est.iteration_time_s
    return out
