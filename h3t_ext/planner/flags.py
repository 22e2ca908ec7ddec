"""Megatron launch flags of a plan, and back.

:func:`megatron_flags` is what ``h3t-plan search`` prints per plan and what the training
driver's ``--auto-plan`` appends to its own argument list; :func:`plan_from_megatron_flags`
reads such a list back (the two round-trip).
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from h3t_ext.ckpt import SELECTIVE_CORE_ATTN, Ckpt, split_ckpt
from h3t_ext.costmodel import Plan
from h3t_ext.offload_alpha import OffloadAlpha, format_alpha
from h3t_ext.planner.translate import MEGATRON_FSDP_CKPT_FORMAT, plan_from_args




def megatron_flags(plan: Plan, *, moe: bool = False) -> list[str]:
    """The Megatron (plus h3t-ext) command-line flags that launch ``plan``.

    ``--sequence-parallel`` (with t > 1), ``--use-distributed-optimizer`` and ``--tp-comm-overlap`` follow
    the plan's switches; a Megatron FSDP plan's ``--use-megatron-fsdp --data-parallel-sharding-strategy S`` comes with
    ``--ckpt-format fsdp_dtensor``, without which Megatron-LM 0.16-0.19 refuse to start; Megatron's recompute follows
    ``--ckpt`` (``--recompute-granularity full --recompute-method block --recompute-num-layers N`` for a block plan; ckpt ``selective`` as ``--ckpt no --recompute-granularity selective
    --recompute-modules core_attn``, which the driver takes); an FP8 plan adds ``--fp8-format``, ``--fp8-recipe`` (and ``--fp8-param-gather``). ``--seq-length`` and
    the GPU count are the launcher's business and are not repeated here. A MoE model's plan (``moe``) runs on
    Megatron-LM's own loop (h3t-ext's runtime has no MoE layers): its expert flags, and neither ``--ckpt`` nor
    ``--offload-alpha`` (its plans have ckpt no and alpha 0).
    """
    flags = ["--tensor-model-parallel-size", str(plan.tensor_model_parallel_size)]
    if plan.context_parallel_size > 1:
        flags += ["--context-parallel-size", str(plan.context_parallel_size)]
    flags += ["--pipeline-model-parallel-size", str(plan.pipeline_model_parallel_size)]
    if plan.num_layers_per_virtual_pipeline_stage is not None:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(plan.num_layers_per_virtual_pipeline_stage)]
    flags += [flag for flag, attr in _SPLIT_INTS.items() if getattr(plan, attr) is not None
              for flag in (flag, str(getattr(plan, attr)))]
    flags += [flag for flag, attr in _SPLIT_SWITCHES.items() if getattr(plan, attr)]
    if plan.pipeline_model_parallel_layout is not None:
        flags += ["--pipeline-model-parallel-layout", plan.pipeline_model_parallel_layout]
    if plan.expert_model_parallel_size > 1:
        flags += ["--expert-model-parallel-size", str(plan.expert_model_parallel_size)]
    if plan.expert_tensor_parallel_size is not None:
        flags += ["--expert-tensor-parallel-size", str(plan.expert_tensor_parallel_size)]
    if plan.moe_token_dispatcher_type != "allgather":
        flags += ["--moe-token-dispatcher-type", plan.moe_token_dispatcher_type]
    if plan.tensor_model_parallel_size > 1 and plan.sequence_parallel:
        flags.append("--sequence-parallel")
    if plan.use_distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    if plan.data_parallel_sharding_strategy is not None:
        flags += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", plan.data_parallel_sharding_strategy,
                  "--ckpt-format", MEGATRON_FSDP_CKPT_FORMAT]
    if plan.use_torch_fsdp2:
        flags.append("--use-torch-fsdp2")
        if not plan.torch_fsdp2_reshard_after_forward:
            flags.append("--torch-fsdp2-no-reshard-after-forward")
    if plan.attention_backend != "auto":  # Megatron's default
        flags += ["--attention-backend", plan.attention_backend]
    if plan.transformer_impl != "transformer_engine":
        flags += ["--transformer-impl", plan.transformer_impl]
    if not plan.bias_activation_fusion:
        flags.append("--no-bias-swiglu-fusion")
    if plan.cross_entropy_loss_fusion:
        flags.append("--cross-entropy-loss-fusion")
        if plan.cross_entropy_fusion_impl != "native":
            flags += ["--cross-entropy-fusion-impl", plan.cross_entropy_fusion_impl]
    if plan.optimizer_cpu_offload:
        flags += ["--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
                  f"{plan.optimizer_offload_fraction:g}"]
    flags += [flag for flag, attr in _OVERLAP.items() if getattr(plan, attr, False)
              and not (plan.fp16 and attr == "grad_reduce_in_bf16")]
    if plan.fp16:  # Megatron-LM holds an fp16 run's gradients in fp16 unless told to accumulate them in fp32
        flags += ["--fp16"] + ([] if plan.grad_reduce_in_bf16 else ["--accumulate-allreduce-grads-in-fp32"])
    if not plan.overlap_p2p_comm:
        flags.append("--no-overlap-p2p-communication")
    # ckpt selective is h3t-ext's name of Megatron's selective core_attn on ckpt no: the driver takes Megatron's flags
    ckpt, recompute = (Ckpt.NO, SELECTIVE_CORE_ATTN) if plan.ckpt is Ckpt.SELECTIVE else (plan.ckpt, plan.recompute)
    if moe:  # Megatron-LM's own flags only: ckpt full is its uniform recompute of every layer
        flags += [*split_ckpt(plan.ckpt, plan.recompute)[1].flags()]
    else:
        flags += ["--ckpt", str(ckpt), *recompute.flags(), "--offload-alpha", format_alpha(plan.offload_alpha)]
    flags += ["--micro-batch-size", str(plan.micro_batch_size), "--global-batch-size", str(plan.global_batch_size)]
    if plan.fp8 is not None:
        flags += ["--fp8-format", plan.fp8, "--fp8-recipe", plan.fp8_recipe]
        if plan.fp8_param_gather:
            flags.append("--fp8-param-gather")
        if plan.first_last_layers_bf16:
            flags += ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(plan.num_layers_at_start_in_bf16),
                      "--num-layers-at-end-in-bf16", str(plan.num_layers_at_end_in_bf16)]
    return flags


_INT_FLAGS = {
    "--tensor-model-parallel-size": "tensor_model_parallel_size",
    "--context-parallel-size": "context_parallel_size",
    "--pipeline-model-parallel-size": "pipeline_model_parallel_size",
    "--num-layers-per-virtual-pipeline-stage": "num_layers_per_virtual_pipeline_stage",
    "--micro-batch-size": "micro_batch_size",
    "--global-batch-size": "global_batch_size",
    "--recompute-num-layers": "recompute_num_layers",
    "--expert-model-parallel-size": "expert_model_parallel_size",
    "--expert-tensor-parallel-size": "expert_tensor_parallel_size",
    "--num-layers-at-start-in-bf16": "num_layers_at_start_in_bf16",
    "--num-layers-at-end-in-bf16": "num_layers_at_end_in_bf16",
}
_SPLIT_INTS = {
    "--num-virtual-stages-per-pipeline-rank": "num_virtual_stages_per_pipeline_rank",
    "--decoder-first-pipeline-num-layers": "decoder_first_pipeline_num_layers",
    "--decoder-last-pipeline-num-layers": "decoder_last_pipeline_num_layers",
    "--microbatch-group-size-per-virtual-pipeline-stage": "microbatch_group_size_per_vp_stage",
}
"""Megatron's flags of the layer split (uneven stages, virtual stages given as a count) and of the interleaved
schedule's microbatch groups, when set."""
_SPLIT_SWITCHES = {
    "--account-for-embedding-in-pipeline-split": "account_for_embedding_in_pipeline_split",
    "--account-for-loss-in-pipeline-split": "account_for_loss_in_pipeline_split",
}
_INT_FLAGS.update(_SPLIT_INTS)
_SWITCHES = frozenset({"--sequence-parallel", "--use-distributed-optimizer", "--use-megatron-fsdp",
                       "--no-bias-swiglu-fusion",
                       "--no-overlap-p2p-communication", "--use-precision-aware-optimizer", "--use-torch-fsdp2",
                       "--torch-fsdp2-no-reshard-after-forward"})
_OVERLAP = {"--moe-grouped-gemm": "moe_grouped_gemm", "--moe-shared-expert-overlap": "moe_shared_expert_overlap",
            "--overlap-moe-expert-parallel-comm": "overlap_moe_expert_parallel_comm",
            "--overlap-grad-reduce": "overlap_grad_reduce", "--overlap-param-gather": "overlap_param_gather",
            "--tp-comm-overlap": "tp_comm_overlap",
            "--overlap-cpu-optimizer-d2h-h2d": "overlap_cpu_optimizer_d2h_h2d",
            "--grad-reduce-in-bf16": "grad_reduce_in_bf16"}
_FAMILY_SWITCHES = {"--fp8-param-gather": "fp8_param_gather", "--first-last-layers-bf16": "first_last_layers_bf16",
                    "--cross-entropy-loss-fusion": "cross_entropy_loss_fusion"}
"""Switches :func:`megatron_flags` prints beside their family (after --fp8-recipe; before
--cross-entropy-fusion-impl), not with ``_OVERLAP``'s."""
_PRECISION = {"--fp16": "fp16", "--accumulate-allreduce-grads-in-fp32": "accumulate_allreduce_grads_in_fp32"}
"""An fp16 plan's switches (its gradient dtype follows from them: ``translate.sixteen_bit_grads``)."""
_TRUE_SWITCHES = {**_OVERLAP, **_FAMILY_SWITCHES, **_SPLIT_SWITCHES, **_PRECISION}
"""The switches :func:`plan_from_megatron_flags` reads as True when given."""
_TEXT_FLAGS = {"--ckpt": "ckpt", "--data-parallel-sharding-strategy": "data_parallel_sharding_strategy",
               "--fp8-format": "fp8", "--fp8-recipe": "fp8_recipe", "--attention-backend": "attention_backend",
               "--transformer-impl": "transformer_impl", "--recompute-granularity": "recompute_granularity",
               "--recompute-method": "recompute_method",
               "--pipeline-model-parallel-layout": "pipeline_model_parallel_layout",
               "--moe-token-dispatcher-type": "moe_token_dispatcher_type",
               "--cross-entropy-fusion-impl": "cross_entropy_fusion_impl"}


def plan_from_megatron_flags(flags: Sequence[str], *, num_gpus: int, seq_length: int,
                             num_experts: Optional[int] = None) -> Plan:
    """Read a flag list made by :func:`megatron_flags` back into a :class:`Plan` (through the one translation,
    :func:`h3t_ext.planner.translate.plan_from_args`); ValueError on a flag it does not make. ``num_experts``: the
    model's (the flags of a plan carry no model shape; MoE recompute modules need it)."""
    ns = argparse.Namespace(seq_length=seq_length, num_experts=num_experts, ckpt=None if num_experts is None else "no",
                            use_distributed_optimizer="--use-distributed-optimizer" in flags,
                            overlap_p2p_comm="--no-overlap-p2p-communication" not in flags,
                            sequence_parallel="--sequence-parallel" in flags,
                            use_megatron_fsdp="--use-megatron-fsdp" in flags,
                            use_torch_fsdp2="--use-torch-fsdp2" in flags,
                            bias_swiglu_fusion="--no-bias-swiglu-fusion" not in flags,
                            torch_fsdp2_reshard_after_forward="--torch-fsdp2-no-reshard-after-forward" not in flags)
    alpha = 0.0
    flags = list(flags)
    if "--recompute-modules" in flags:  # its values run to the next flag
        i = flags.index("--recompute-modules")
        j = next((k for k in range(i + 1, len(flags)) if flags[k].startswith("--")), len(flags))
        ns.recompute_modules, flags = flags[i + 1:j], flags[:i] + flags[j:]
    it = iter(flags)
    for flag in it:
        if flag == "--optimizer-cpu-offload":
            ns.optimizer_cpu_offload = True
            continue
        if flag in _SWITCHES:
            continue
        if flag in _TRUE_SWITCHES:
            setattr(ns, _TRUE_SWITCHES[flag], True)
            continue
        if flag not in _INT_FLAGS and flag not in _TEXT_FLAGS and flag not in ("--offload-alpha",
                                                                               "--optimizer-offload-fraction",
                                                                               "--ckpt-format"):
            raise ValueError(f"unexpected flag {flag!r}")
        value = next(it, None)
        if value is None:
            raise ValueError(f"flag {flag} needs a value")
        if flag == "--ckpt-format":
            if value != MEGATRON_FSDP_CKPT_FORMAT or "--use-megatron-fsdp" not in flags:
                raise ValueError(f"unexpected --ckpt-format {value} (made only as {MEGATRON_FSDP_CKPT_FORMAT}, with "
                                 "--use-megatron-fsdp)")
        elif flag in _TEXT_FLAGS:
            setattr(ns, _TEXT_FLAGS[flag], value)
        elif flag == "--optimizer-offload-fraction":
            ns.optimizer_offload_fraction = float(value)
        elif flag == "--offload-alpha":
            alpha = OffloadAlpha.parse(value).alpha
        else:
            setattr(ns, _INT_FLAGS[flag], int(value))
    if getattr(ns, "tensor_model_parallel_size", 1) == 1:
        ns.sequence_parallel = True  # a no-op at t = 1, where megatron_flags leaves the flag out; Plan's default
    return plan_from_args(ns, num_gpus=num_gpus, offload_alpha=alpha)
