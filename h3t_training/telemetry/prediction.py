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
    from h3t_ext.costmodel.activations import stage_activation_peak_bytes
    from h3t_ext.costmodel.errors import PlanError, UnknownNameError
    from h3t_ext.costmodel.estimate import estimate
    from h3t_training.config.auto_plan import system_name
    from h3t_training.config.run_spec import activation_spec, model_spec, run_plan

    model = model_spec(args, vocab_size, name="run")
    plan = run_plan(args, offload_alpha=args.offload_alpha, on_gpu=on_gpu)
    out: dict[str, float] = {}
    try:
        acts = stage_activation_peak_bytes(model, plan, sequence_parallel=args.sequence_parallel,
                                           **activation_spec(args, on_gpu=on_gpu))
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
