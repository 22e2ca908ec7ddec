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


def predicted_scalars(args, *, vocab_size: int, on_gpu: bool) -> dict[str, float]:
    """Tag -> predicted value for this run's plan (:func:`h3t_training.config.run_spec.run_plan`); tags the cost model
    cannot price are left out."""
    from h3t_ext.costmodel import get_system
    from h3t_ext.costmodel.activations import BOOL, stage_activation_peak_bytes
    from h3t_ext.costmodel.errors import PlanError, UnknownNameError
    from h3t_ext.costmodel.estimate import estimate
    from h3t_training.config.auto_plan import system_name
    from h3t_training.config.run_spec import model_spec, run_plan, uses_transformer_engine

    model = model_spec(args, vocab_size, name="run")
    plan = run_plan(args, offload_alpha=args.offload_alpha, on_gpu=on_gpu)
    out: dict[str, float] = {}
    te = uses_transformer_engine(on_gpu, args)
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
