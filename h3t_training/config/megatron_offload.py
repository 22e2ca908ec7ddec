"""Megatron-LM's activation offload flags run as h3t-ext's offload (two resolve steps).

``--fine-grained-activation-offloading --offload-modules ...`` (with ``--activation-offload-fraction``,
``--min-offloaded-tensor-size``) and ``--cpu-offloading-num-layers N`` become the ``--offload-alpha`` that moves
the same saved bytes, computed by the library (:mod:`h3t_ext.costmodel.megatron_offload`, through the planner's
one translation :func:`h3t_ext.planner.translate.megatron_offload_mapping`) in the terms of the layer spec this
run builds (megatron-core's local spec in fp32 on CPU; TransformerEngine's on a GPU that has it). One notice
states the mapping. What the mapping refuses, and these flags with ``--offload-alpha`` (or Megatron-Kwai's
ratio) or ``--auto-plan``, is one line (exit status 2) before any process group.
"""
from __future__ import annotations

from h3t_ext.costmodel.megatron_offload import MegatronOffloadError, MegatronOffloadMapping
from h3t_ext.planner.translate import megatron_offload_from_args, megatron_offload_mapping
from h3t_training.config import feature_checks
from h3t_training.config.flag_table import table_value
from h3t_training.config.run_spec import activation_spec, model_spec, run_plan
from h3t_training.errors import ArgumentError

_TUNING = (("--activation-offload-fraction", "activation_offload_fraction"),
           ("--min-offloaded-tensor-size", "min_offloaded_tensor_size"),
           ("--delta-offload-bytes-across-pp-ranks", "delta_offload_bytes_across_pp_ranks"))


def check_offload_requests(args):
    """A resolve step before ``--auto-plan`` and the defaults: Megatron's offload flags are one offload request
    (not with ``--offload-alpha``, Megatron-Kwai's ratio, or ``--auto-plan``, which chooses the alpha); the
    fine-grained tuning flags without ``--fine-grained-activation-offloading`` get a notice (no effect, as in
    Megatron-LM)."""
    request = megatron_offload_from_args(args)
    if not request.requested:
        idle = [flag for flag, name in _TUNING if getattr(args, name) is not None]
        if not idle or args.offload_modules:
            return args  # --offload-modules alone is refused by the mapping step
        return args.replace(flag_notices=(*args.flag_notices, f"note: {', '.join(idle)}: no effect without "
                                                              "--fine-grained-activation-offloading (as in Megatron-LM)"))
    flags = request.flags()
    if args.offload_alpha is not None:
        raise ArgumentError(f"{flags} and --offload-alpha {args.offload_alpha} (or --kaimm-offload-activation-ratio) "
                            "are two offload requests; give one")
    if args.auto_plan:
        raise ArgumentError(f"{flags} is not supported with --auto-plan (the planner chooses --offload-alpha); give "
                            "one of them")
    if request.fine_grained_activation_offloading and table_value(args, "--transformer-impl") == "local":
        raise ArgumentError("--fine-grained-activation-offloading needs --transformer-impl transformer_engine (as "
                            "Megatron-LM asserts)")
    return args


def map_offload_request(args):
    """A resolve step after the parallel defaults: the request's alpha becomes ``offload_alpha``, with one notice;
    ``--offload-modules`` without ``--fine-grained-activation-offloading`` and the mapping's refusals are one
    line."""
    request = megatron_offload_from_args(args)
    if not (request.requested or request.offload_modules or request.cpu_offloading_num_layers):
        return args  # a negative --cpu-offloading-num-layers requests nothing, and is refused by the mapping
    on_gpu = feature_checks.uses_gpu(args)
    spec = activation_spec(args, on_gpu=on_gpu)
    te = spec["layer_spec"] == "te"
    plan = run_plan(args, on_gpu=on_gpu)
    model = model_spec(args, args.tokenizer_vocab_size)
    try:
        mapping = megatron_offload_mapping(args, model, plan, **spec, fp8=te and plan.fp8 is not None)
    except MegatronOffloadError as e:
        raise ArgumentError(str(e)) from None
    line = notice(request.flags(), mapping, args.pipeline_model_parallel_size, request.min_offloaded_tensor_size,
                  spec="TransformerEngine's" if te else "megatron-core's local")
    return args.replace(offload_alpha=mapping.alpha, flag_notices=(*args.flag_notices, line))


def notice(flags: str, mapping: MegatronOffloadMapping, pipeline_model_parallel_size: int, min_size: int, *,
           spec: str) -> str:
    """The one line stating the mapping."""
    a = f"{mapping.alpha:.3f}"
    where = "microbatch's, layer by layer" if pipeline_model_parallel_size == 1 else "microbatch-chunk's"
    if not mapping.tensors and mapping.alpha > 0:  # --cpu-offloading-num-layers
        return (f"note: {flags}: runs as --offload-alpha {mapping.alpha:g} (h3t-ext's offload moves the saved bytes "
                f"of the first {mapping.offloaded_bytes} of the {mapping.layer_bytes} layers whole, as "
                "TransformerEngine's layer offload does)")
    counted = sorted({x.term for x in mapping.tensors if x.counted})
    kept = sorted({x.term for x in mapping.tensors if not x.counted})
    skipped = f"; {', '.join(mapping.skipped_modules)} fused into the next linear in {spec} spec, no group of " \
              "its own" if mapping.skipped_modules else ""
    if mapping.alpha == 0:
        return (f"note: {flags}: runs without offload (--offload-alpha 0): no listed module's saved tensor has "
                f"--min-offloaded-tensor-size {min_size} elements or more here ({spec} spec{skipped}), so Megatron-LM "
                "would offload nothing either")
    left = f"; left on the device: {', '.join(kept)}" if kept else ""
    return (f"note: {flags}: runs as --offload-alpha {a} (h3t-ext offloads the same saved bytes, the first {a} of "
            f"each {where}, in save order, not these modules' tensors; counted in {spec} spec: {', '.join(counted)}"
            f"{left}{skipped})")


__all__ = ["check_offload_requests", "map_offload_request", "notice"]
