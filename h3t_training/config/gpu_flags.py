"""The flag table's GPU column: what a table flag that the CPU run notices does when the run uses a GPU
(:func:`~h3t_training.config.feature_checks.uses_gpu`).

The rule (DEVELOPERS.md): a flag that changes memory, speed or numerics on a GPU is never accepted and ignored.
On a GPU such a flag is either *implemented* -- passed to megatron-core's own machinery, the ``TransformerConfig``,
``DistributedDataParallelConfig`` or ``OptimizerConfig`` the driver builds (:mod:`h3t_training.config.megatron_fields`
maps each one) -- or *refused* in one line naming the flag, why and the alternative (exit status 2, before any
process group). A flag keeps a *notice* on a GPU only where its effect there is truly nil for this driver: a code
path the driver never takes, logging, profiling (:data:`GPU_NEUTRAL`, each with why).

:data:`GPU_BY_REASON` gives the rule of every flag of a reason of :data:`~h3t_training.config.flag_table.REASONS`,
:data:`GPU_BY_FLAG` a flag's own rule where it differs from its reason's. A reason with no rule here
(implemented, refused, and ``megatron_offload``, whose flags are mapped separately) acts on a GPU as on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from h3t_training.config.fp8_flags import FP8_FLAGS


@dataclass(frozen=True)
class GpuRule:
    """What a flag does on a GPU: ``cls`` ('implemented', 'noticed' or 'refused'), why (``text``), what to use
    instead (``alternative``). ``needs_te``: implemented only where TransformerEngine is importable, refused
    naming it elsewhere -- for every value, or (``te_values``) only for those values."""

    cls: str
    text: str
    alternative: str = ""
    needs_te: bool = False
    te_values: tuple[str, ...] = ()


def _refused(text: str, alternative: str = "leave it out") -> GpuRule:
    return GpuRule("refused", text, alternative)


def _neutral(text: str) -> GpuRule:
    return GpuRule("noticed", text, "none needed")


def _mcore(field: str, what: str = "", *, needs_te: bool = False, te_values: tuple[str, ...] = ()) -> GpuRule:
    return GpuRule("implemented", f"megatron-core's {field}{what}", needs_te=needs_te, te_values=te_values)


_TE_FP8 = " (FP8 through TransformerEngine's layers, as in Megatron-LM)"

GPU_NEUTRAL: dict[str, GpuRule] = {
    "other_model": _neutral("used by other Megatron-LM models and entry points (BERT, T5, vision, retrieval, RL, "
                            "inference); pretrain_gpt.py does not read it, on a GPU either"),
    "kaimm_sync": _neutral("Megatron-Kwai's extra CUDA synchronisations to attribute time to kernels; this driver "
                           "inserts none (they only make a step slower), the model trained is the same"),
    "kaimm_warmup": _neutral("warm-up iterations of Megatron-Kwai's own kernel tuning, which this driver does not "
                             "have; the iterations trained are the same"),
    "profiling": _neutral("profiling / tracing / extra diagnostics are not collected by this driver; a step runs "
                          "the same kernels without them"),
    "data_loading": _neutral("a data-loader setting; the driver reads the same samples in the same order from "
                             "memory-mapped files in the training process (no loader workers), on a GPU as on CPU"),
    "expert_layout": _neutral("the tensor-parallel size of MoE expert layers; a dense model has none to split, on a "
                              "GPU as on CPU"),
    "resilience": _neutral("fault tolerance / restart / straggler / rerun machinery of Megatron-LM's GPU clusters "
                           "is not part of this driver; without a fault, a step is the same"),
    "ckpt_io": _neutral("a checkpoint I/O strategy setting; this driver writes megatron-core torch_dist "
                        "checkpoints synchronously with every shard, on a GPU as on CPU (the steps between saves "
                        "are the same)"),
    "megatron_offload_tuning": _neutral("a setting of Megatron-LM's own offload manager, which this driver does not "
                                        "run on a GPU either: Megatron's offload request runs as h3t-ext's "
                                        "--offload-alpha, whose pinned host pool persists and which copies one layer "
                                        "at a time on its own CUDA stream; no MoE groups exist"),
    "param_group_dump": _neutral("writes a diagnostic file of the optimizer's parameter groups; not written by this "
                                 "driver, on a GPU either, and training is the same"),
    "fsdp": _neutral("a setting of Megatron FSDP or of several distributed-optimizer instances; without "
                     "--use-megatron-fsdp it has no effect, as in Megatron-LM (with it, its Megatron FSDP tuning flags "
                     "are refused in one line: feature_checks.check_megatron_fsdp)"),
}
"""Reasons whose flags keep their notice on a GPU, with why that is true there."""

GPU_BY_REASON: dict[str, GpuRule] = {
    **GPU_NEUTRAL,
    "kaimm_cp": _refused("Megatron-Kwai's context-parallel KV gather/offload tuning (NCCL CTAs, offload mode) is "
                         "not implemented; on a GPU it changes speed and memory",
                         "leave it out (TransformerEngine's context-parallel attention runs)"),
    "fusion": _refused("a GPU kernel-fusion switch this driver does not wire into megatron-core; on a GPU it "
                       "changes speed", "leave it out (the driver's kernels run)"),
    "attention_backend": _refused("an attention kernel choice this driver does not wire into megatron-core; on a "
                                  "GPU it changes speed, memory or numerics",
                                  "--attention-backend (with TransformerEngine)"),
    "precision": _refused("a low-precision or precision-aware setting this driver does not wire into megatron-core; "
                          "on a GPU it changes memory and numerics",
                          "--bf16 / --fp16, --fp8-format with TransformerEngine"),
    "comm_overlap": _refused("a GPU communication / overlap / bucketing setting this driver does not wire into "
                             "megatron-core; on a GPU it changes speed or memory",
                             "leave it out (--overlap-grad-reduce / --overlap-param-gather are implemented)"),
    "cuda_graphs": _refused("CUDA graphs are not wired by this driver; on a GPU they change speed and memory",
                            "leave it out (eager kernels)"),
    "megatron_fsdp": _mcore("DistributedDataParallelConfig.use_megatron_fsdp / data_parallel_sharding_strategy",
                            " through its FullyShardedDataParallel adapter, as Megatron-LM's get_model wraps the "
                            "chunks (with --use-distributed-optimizer and --ckpt-format fsdp_dtensor, as Megatron-LM "
                            "requires; without --save/--load, which Megatron-LM does only in that format and this "
                            "driver does not)"),
}
"""The GPU rule of every flag of a reason (overridden per flag by :data:`GPU_BY_FLAG`)."""

_NOT_A_FIELD = "is not a field of megatron-core 0.16.1's TransformerConfig"

GPU_BY_FLAG: dict[str, GpuRule] = {
    # precision: FP8 through TransformerEngine (the one list, fp8_flags.FP8_FLAGS), the precision-aware
    # optimizer's dtypes, gradient reduction
    **{f.flag: _mcore(f.gpu_column, _TE_FP8, needs_te=True) for f in FP8_FLAGS},
    "--fp4-format": _refused("FP4 training is not wired by this driver (megatron-core's fp4 needs TransformerEngine's "
                             "NVFP4 recipe on Blackwell GPUs)", "--fp8-format with TransformerEngine, or --bf16"),
    "--fp4-recipe": _refused("FP4 training is not wired by this driver", "--fp8-recipe"),
    "--fp4-param-gather": _refused("FP4 training is not wired by this driver", "--fp8-param-gather"),
    "--fp4-quantizer-factory": _refused("FP4 training is not wired by this driver", "--fp8-quantizer-factory"),
    "--accumulate-allreduce-grads-in-fp32": _mcore(
        "DistributedDataParallelConfig.grad_reduce_in_fp32", " (True: the driver's default with --bf16; with --fp16 "
        "it keeps fp32 gradients, which Megatron-LM holds in fp16 otherwise)"),
    "--grad-reduce-in-bf16": _mcore("DistributedDataParallelConfig.grad_reduce_in_fp32",
                                    " (False: gradients reduced in bfloat16, as in Megatron-LM)"),
    "--fp32-residual-connection": _mcore("TransformerConfig.fp32_residual_connection"),
    "--main-grads-dtype": _mcore("OptimizerConfig.main_grads_dtype", " (needs --use-precision-aware-optimizer)"),
    "--main-params-dtype": _mcore("OptimizerConfig.main_params_dtype", " (needs --use-precision-aware-optimizer)"),
    "--exp-avg-dtype": _mcore("OptimizerConfig.exp_avg_dtype", " (needs --use-precision-aware-optimizer)"),
    "--exp-avg-sq-dtype": _mcore("OptimizerConfig.exp_avg_sq_dtype", " (needs --use-precision-aware-optimizer)"),
    # fusion: megatron-core's TransformerConfig / DDP fields
    "--no-bias-dropout-fusion": _mcore("TransformerConfig.bias_dropout_fusion (False)"),
    "--no-bias-gelu-fusion": _mcore("TransformerConfig.bias_activation_fusion (False without --swiglu)"),
    "--no-bias-swiglu-fusion": _mcore("TransformerConfig.bias_activation_fusion (False with --swiglu)"),
    "--no-masked-softmax-fusion": _mcore("TransformerConfig.masked_softmax_fusion (False)"),
    "--no-persist-layer-norm": _mcore("TransformerConfig.persist_layer_norm (False)"),
    "--no-rope-fusion": _mcore("TransformerConfig.apply_rope_fusion (False)"),
    "--no-gradient-accumulation-fusion": _mcore("TransformerConfig.gradient_accumulation_fusion (False)"),
    "--no-gradient-reduce-div-fusion": _mcore("DistributedDataParallelConfig.gradient_reduce_div_fusion (False)"),
    "--cross-entropy-loss-fusion": _mcore("TransformerConfig.cross_entropy_loss_fusion (its fused vocab-parallel "
                                          "cross entropy in GPTModel's loss)"),
    "--cross-entropy-fusion-impl": _mcore("TransformerConfig.cross_entropy_fusion_impl", " ('te' needs "
                                          "TransformerEngine)", te_values=("te",)),
    "--fused-residual-rmsnorm": _refused(f"a fused residual + RMSNorm kernel that {_NOT_A_FIELD}"),
    "--use-transformer-engine-op-fuser": _refused(f"TransformerEngine's operation fuser, which {_NOT_A_FIELD}"),
    "--use-te-activation-func": _refused("h3t-ext's layer spec builds the MLP activation itself (--ckpt ours "
                                         "recomputes it); TransformerEngine's activation module is not wired"),
    "--disable-jit-fuser": _refused("switches megatron-core's JIT-fused elementwise kernels off process-wide; this "
                                    "driver does not, and on a GPU the kernels differ in speed"),
    "--use-fast-rms-norm": _mcore("TransformerEngine RMSNorm", " (Megatron-Kwai's fused RMSNorm: the TransformerEngine "
                                  "layer spec's norm is TransformerEngine's fused kernel)", needs_te=True),
    "--use-fast-rope": _mcore("TransformerConfig.apply_rope_fusion (True)", " (Megatron-Kwai's fused RoPE: "
                              "TransformerEngine's fused rotary embedding, as megatron-core fuses it)", needs_te=True),
    # attention kernels
    "--attention-backend": _mcore("TransformerConfig.attention_backend", " (it selects TransformerEngine's "
                                  "flash / fused / unfused attention; 'local' is refused on a GPU: the driver's "
                                  "TransformerEngine spec has no local attention; with --transformer-impl local "
                                  "only flash and auto: that spec's attention is PyTorch's SDPA)", needs_te=True),
    "--use-flash-attn": _mcore("TransformerConfig.attention_backend (flash, when --attention-backend is not given)",
                               needs_te=True),
    "--transformer-impl": _mcore("layer spec", " (transformer_engine: TransformerEngine's, needs it; local: "
                                 "megatron-core's local modules)", te_values=("transformer_engine",)),
    "--attention-softmax-in-fp32": _mcore("TransformerConfig.attention_softmax_in_fp32 (True)"),
    "--no-query-key-layer-scaling": _mcore("TransformerConfig.apply_query_key_layer_scaling (False, the driver's "
                                           "default)"),
    "--disable-bf16-reduced-precision-matmul": _mcore("TransformerConfig.disable_bf16_reduced_precision_matmul"),
    "--apply-query-key-layer-scaling": _refused(
        "query-key layer scaling changes fp16 attention numerics; TransformerEngine's attention takes it from "
        "NVTE_APPLY_QK_LAYER_SCALING, which this driver does not set", "leave it out"),
    "--onnx-safe": _neutral("an ONNX-export setting; the trained model is the same"),
    "--use-mcore-models": _neutral("megatron-core's models are the only ones (the flag is a no-op in Megatron-LM "
                                   "too)"),
    # communication
    "--local-rank": _neutral("the launcher's local rank; the driver takes LOCAL_RANK from the launcher's "
                             "environment (torchrun, srun, mpirun), the same device"),
    "--ddp-bucket-size": _mcore("DistributedDataParallelConfig.bucket_size"),
    "--ddp-average-in-collective": _mcore("DistributedDataParallelConfig.average_in_collective"),
    "--ddp-pad-buckets-for-high-nccl-busbw": _mcore("DistributedDataParallelConfig.pad_buckets_for_high_nccl_busbw"),
    # fsdp: not all of its flags are Megatron FSDP's
    "--num-distributed-optimizer-instances": _refused(
        "several distributed-optimizer instances change the gradient and parameter communication on a GPU; the "
        "driver runs one", "leave it out (one instance)"),
    "--use-cpu-initialization": _refused("initialising the weights on the host (megatron-core's CPU init path) and "
                                         "copying them changes start-up memory and time on a GPU; not wired by "
                                         "this driver",
                                         "leave it out (weights are initialised on the device)"),
    # resilience / memory
    "--deterministic-mode": _refused("deterministic mode selects deterministic CUDA kernels and NCCL algorithms "
                                     "(numerics and speed); not wired by this driver", "leave it out"),
    "--train-sync-interval": _refused("bounds how far the host runs ahead of the GPU (memory of queued work and "
                                      "speed); not wired by this driver", "leave it out"),
}
"""Flags whose GPU rule is not their reason's."""


__all__ = ["GPU_BY_FLAG", "GPU_BY_REASON", "GPU_NEUTRAL", "GpuRule"]
