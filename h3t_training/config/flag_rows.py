"""The rows of the flag table (:mod:`h3t_training.config.flag_table`): every flag of Megatron-LM's ``pretrain_gpt.py``
and of Megatron-Kwai's ATC'24 scripts, grouped by the reason for its class, with how many values it takes
(``flag=arity``: Megatron's nargs, '0', '1', '+', '*' or a count), and the reasons themselves. Data only: the table's
logic (parsing, notices, refusals, the GPU column) is in ``flag_table``."""
from __future__ import annotations

from dataclasses import dataclass

MEGATRON_LM_SOURCE = ("https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/"
                      "megatron/training/arguments.py")
KWAI_SOURCE = ("https://github.com/kwai/Megatron-Kwai/blob/b2646e4d9f244b90de44352ac742a1494a4781cc/"
               "megatron/arguments.py (ATC'24 scripts: examples/atc24/)")


@dataclass(frozen=True)
class Reason:
    """Why a flag is in its class (``text``) and what to use instead (``alternative``)."""

    cls: str
    text: str
    alternative: str = ""


REASONS: dict[str, Reason] = {
    "implemented": Reason("implemented", "implemented as in Megatron-LM"),
    "kaimm_cp": Reason("noticed", "Megatron-Kwai's context-parallel KV gather/offload tuning (NCCL CTAs, offload mode) "
                       "for GPUs; the CPU ring attention computes the same", "none needed"),
    "kaimm_sync": Reason("noticed", "Megatron-Kwai's CUDA synchronisation level; CPU ops are synchronous", "none needed"),
    "kaimm_warmup": Reason("noticed", "Megatron-Kwai's warm-up iterations for tuning on GPU; not run here", "none needed"),
    "deprecated": Reason("refused", "removed from Megatron-LM (its own parser rejects it)",
                    "see the flag named in Megatron-LM's message"),
    "moe": Reason("refused", "mixture-of-experts layers are not implemented; without them the model would be dense",
                    "a dense model (leave the MoE flags out)"),
    "expert_layout": Reason("noticed", "the tensor-parallel size of MoE expert layers; a dense model has no expert "
                            "layers to split (a MoE model is refused through --num-experts), so the result is the same",
                            "none needed"),
    "mla": Reason("refused", "multi-latent attention is not implemented",
                    "standard multi-head / grouped-query attention"),
    "hybrid": Reason("refused", "Mamba / hybrid / experimental attention variants / multi-token prediction are not implemented",
                    "a transformer decoder (leave the flag out)"),
    "attn_variant": Reason("refused", "this attention / embedding variant is not implemented and would change the model",
                    "leave it out (causal full attention, rope or learned positions)"),
    "activation": Reason("refused", "this MLP activation is not implemented and would change the model",
                    "GeLU (default) or --swiglu"),
    "init": Reason("refused", "this initialisation is not implemented and would give other weights",
                    "--init-method-std"),
    "megatron_fails": Reason("refused", "Megatron-LM 0.16-0.19 itself stops on it: core_transformer_config_from_args "
                                        "passes scaled_init_method, a field TransformerConfig does not have (TypeError "
                                        "before the model is built)", "--init-method-std"),
    "optimizer": Reason("refused", "only Adam(W) is implemented",
                    "--optimizer adam"),
    "data": Reason("refused", "this data source / sample construction is not implemented and would train on other samples",
                    "--data-path [weight] prefix ... with --split, or --mock-data"),
    "tokenizer": Reason("refused", "this tokenizer setting is not implemented and would give other token ids",
                    "--tokenizer-type with --tokenizer-model / --vocab-file / --merge-file / --vocab-size"),
    "distill": Reason("refused", "logit distillation / RL training changes the loss; not implemented",
                    "plain language-model pretraining"),
    "modelopt": Reason("refused", "a flag of Megatron-LM's post-training with NVIDIA ModelOpt (megatron/post_training/"
                       "arguments.py: knowledge distillation, quantization, model export); it changes the loss, "
                       "the model or its numerics; not implemented", "plain language-model pretraining"),
    "kitchen": Reason("refused", "NVIDIA Kitchen quantization of the linear layers (Megatron-LM defines these flags only "
                      "where the kitchen package is installed); it changes the numerics; not implemented",
                      "bf16, or --fp8-format with TransformerEngine"),
    "ckpt_load": Reason("refused", "this checkpoint loading mode is not implemented",
                    "--load DIR (with --finetune / --no-load-optim / --no-load-rng / --ckpt-step)"),
    "seq_model": Reason("refused", "encoder-decoder layer counts do not describe a GPT model",
                    "--num-layers / --seq-length"),
    "other_model": Reason("noticed", "used by other Megatron-LM models and entry points (BERT, T5, vision, retrieval, RL, inference); pretrain_gpt.py does not read it",
                    "none needed"),
    "fusion": Reason("noticed", "a GPU kernel-fusion switch; the unfused CPU ops compute the same",
                    "none needed"),
    "attention_backend": Reason("noticed", "the attention kernel / implementation choice; on CPU attention runs through torch's scaled_dot_product_attention with the same result",
                    "none needed"),
    "precision": Reason("noticed", "a low-precision (fp16/fp8/fp4) or loss-scaling setting; CPU training is float32 (an FP8 or optimizer-dtype value a GPU run would refuse is refused on CPU too)",
                    "none needed on CPU"),
    "comm_overlap": Reason("noticed", "a GPU communication / overlap / bucketing setting; the CPU driver communicates with gloo in one call, same result",
                    "none needed"),
    "fsdp": Reason("noticed", "a tuning setting of Megatron FSDP or of the distributed optimizer's instances; this driver runs neither Megatron FSDP nor several optimizer instances, same result",
                    "--use-torch-fsdp2 or --use-distributed-optimizer"),
    "torch_fsdp2": Reason("implemented", "torch FSDP2 as in Megatron-LM: megatron-core's TorchFullyShardedDataParallel "
                          "over the data-parallel group, on CPU (gloo) and GPU (h3t_training/loop/fsdp.py; p=1, no "
                          "distributed optimizer, untied embeddings; --save on CPU only)"),
    "megatron_fsdp": Reason("refused", "Megatron FSDP needs CUDA (megatron-core 0.16.1's MegatronFSDP takes "
                            "torch.cuda.current_device(), a 'cuda' device mesh and CUDA streams); on a GPU it runs "
                            "through megatron-core's FullyShardedDataParallel, its strategy left out the installed "
                            "megatron-core's Megatron-LM default (optim_grads_params from 0.18, no_shard before); "
                            "--data-parallel-sharding-strategy no_shard (no sharding) is accepted",
                            "on CPU --use-torch-fsdp2, or --use-distributed-optimizer (optim)"),
    "cuda_graphs": Reason("noticed", "CUDA graphs exist only on a GPU",
                    "none needed"),
    "megatron_offload": Reason("implemented", "Megatron-LM's activation CPU offload (fine-grained modules, or "
                               "--cpu-offloading-num-layers) runs as h3t-ext's: the --offload-alpha that moves the same "
                               "saved bytes, stated in one notice (h3t_ext/costmodel/megatron_offload.py); refused in one "
                               "line: MoE / gdp_qkv modules, attn_proj without core_attn, --offload-modules without "
                               "--fine-grained-activation-offloading, a nonzero --delta-offload-bytes-across-pp-ranks, "
                               "--cpu-offloading-num-layers with p > 1 or recompute, either with --offload-alpha or "
                               "--auto-plan"),
    "megatron_offload_tuning": Reason("noticed", "a setting of Megatron-LM's own offload manager (pinned host buffers "
                                      "kept across iterations; MoE expert groups' copies deferred past CUDA graph "
                                      "replays; in-flight copies per module group), which this driver does not run: its "
                                      "offload is h3t-ext's (--offload-alpha), whose host pool keeps its pinned buffers "
                                      "and which copies one layer at a time on its own stream, and no MoE groups exist",
                                      "none needed"),
    "distribute_saved": Reason("refused", "distributing full recompute's saved layer inputs over the tensor-parallel "
                               "group is not implemented (Megatron-LM allows it only with --recompute-granularity full, "
                               "t > 1 and no sequence parallelism); it changes activation memory",
                               "--sequence-parallel (shards those inputs over the tensor-parallel group too)"),
    "param_group_dump": Reason("noticed", "writes a file of the optimizer's parameter-to-group map (a diagnostic of "
                               "megatron-core's optimizer setup); not written by this driver, no effect on training",
                               "none needed"),
    "optimizer_offload": Reason("implemented", "optimizer CPU offload as in Megatron-LM: megatron-core's "
                                "HybridDeviceOptimizer on a GPU, a host partition with the same split on CPU "
                                "(h3t_training/loop/optimizer_offload.py)"),
    "profiling": Reason("noticed", "profiling / tracing / extra diagnostics are not collected by this driver",
                    "none needed"),
    "memory_mgmt": Reason("implemented", "Python GC and CUDA cache management as in Megatron-LM: --manual-gc "
                          "(automatic collector off, a collection every --manual-gc-interval iterations and around "
                          "evaluations), --empty-unused-memory-level (torch.cuda.empty_cache() after forward-backward "
                          "and optimizer steps on a GPU; CPU has no cache); Megatron-Kwai's --kaimm-gc-interval "
                          "(collector off, generation 0 every N iterations) (h3t_training/config/memory_hygiene.py)"),
    "data_loading": Reason("noticed", "a data-loader performance setting; the driver reads the same samples in the same order",
                    "none needed"),
    "resilience": Reason("noticed", "fault tolerance / restart / straggler / rerun machinery of Megatron-LM's GPU clusters is not part of this driver",
                    "none needed"),
    "sdc_guards": Reason("implemented", "Megatron-LM's silent-data-corruption guards: the weight hash check across "
                         "data-parallel replicas as in Megatron-LM, one line and exit status 5 on a mismatch; "
                         "--rerun-mode: Megatron-LM's default validate_results and report_stats replay an iteration "
                         "after a failed result check, to tell a transient fault from a persistent one; that state "
                         "machine is not part of this driver, which stops at a non-finite loss "
                         "(--check-for-nan-in-loss-and-grad, on by default): without a fault the run is the same; "
                         "given, either is a notice, disabled is what the driver does "
                         "(h3t_training/loop/sdc_guards.py)"),
    "ckpt_io": Reason("noticed", "a checkpoint I/O strategy setting; this driver writes megatron-core torch_dist checkpoints synchronously with every shard",
                    "none needed"),
    "eval_extra": Reason("refused", "validation over the whole validation split at every evaluation, or one loss per "
                         "validation dataset, is not implemented; without it the validation losses reported would "
                         "be others", "--eval-iters N (N batches of --eval-global-batch-size) on one validation split"),
}

# reason key -> 'flag=arity ...' (Megatron-LM's pretrain_gpt.py flags, from its parser at MEGATRON_LM_SOURCE)
MEGATRON_LM: dict[str, str] = {
    "implemented": """
--account-for-embedding-in-pipeline-split=0 --account-for-loss-in-pipeline-split=0
--adam-beta1=1 --adam-beta2=1 --adam-eps=1 --add-qkv-bias=0 --apply-layernorm-1p=0 --async-save=0
--attention-dropout=1 --bf16=0 --calculate-per-token-loss=0 --ckpt-format=1 --ckpt-step=1 --clip-grad=1
--context-parallel-size=1 --data-cache-path=1 --data-path=* --decoder-first-pipeline-num-layers=1
--decoder-last-pipeline-num-layers=1 --decoupled-lr=1 --decoupled-min-lr=1
--decrease-batch-size-if-needed=0 --disable-bias-linear=0 --rampup-batch-size=3 --step-batch-size-schedule=1
--disable-log-loss-scale-to-tensorboard=0 --distributed-backend=1 --distributed-timeout-minutes=1
--eod-mask-loss=0 --reset-position-ids=0 --eval-interval=1 --eval-iters=1 --exit-duration-in-mins=1 --exit-interval=1
--exit-signal=1 --exit-signal-handler=0 --ffn-hidden-size=1 --finetune=0 --global-batch-size=1
--glu-linear-offset=1 --group-query-attention=0 --hidden-dropout=1 --hidden-size=1 --init-method-std=1
--kv-channels=1 --load=1 --pretrained-checkpoint=1 --use-checkpoint-args=0 --use-mp-args-from-checkpoint-args=0
--no-use-tokenizer-model-from-checkpoint-args=0 --disable-use-tokenizer-model-from-checkpoint-args=0 --qk-layernorm=0 --squared-relu=0 --log-interval=1 --log-memory-to-tensorboard=0 --log-throughput=0
--log-timers-to-tensorboard=0 --log-validation-ppl-to-tensorboard=0 --log-world-size-to-tensorboard=0 --lr=1
--lr-decay-iters=1 --lr-decay-samples=1 --lr-decay-style=1 --lr-warmup-fraction=1 --lr-warmup-init=1
--lr-wsd-decay-iters=1 --lr-wsd-decay-samples=1 --lr-wsd-decay-style=1 --start-weight-decay=1
--end-weight-decay=1 --weight-decay-incr-style=1
--lr-warmup-iters=1 --lr-warmup-samples=1 --make-vocab-size-divisible-by=1 --padded-vocab-size=1
--iterations-to-skip=+
--max-position-embeddings=1
--merge-file=1 --micro-batch-size=1 --min-lr=1 --mock-data=0 --no-check-for-nan-in-loss-and-grad=0
--log-params-norm=0 --log-num-zeros-in-grad=0
--eval-global-batch-size=1 --eval-micro-batch-size=1 --start-eval-at-iter=1 --dataloader-type=1 --no-data-sharding=0
--embedding-init-method-std=1 --data-parallel-random-init=0 --no-save-optim=0 --no-save-rng=0
--override-opt-param-scheduler=0 --override-opt_param-scheduler=0 --use-checkpoint-opt-param-scheduler=0
--use-checkpoint-opt_param-scheduler=0 --exit-on-missing-checkpoint=0
--train-data-path=* --valid-data-path=* --test-data-path=* --data-args-path=1 --per-split-data-args-path=1
--no-load-optim=0 --no-load-rng=0 --no-log-loss-scale-to-tensorboard=0 --no-position-embedding=0
--norm-epsilon=1 --normalization=1 --num-attention-heads=1 --num-layers=1
--num-layers-per-virtual-pipeline-stage=1 --num-query-groups=1 --num-virtual-stages-per-pipeline-rank=1
--optimizer=1 --overlap-grad-reduce=0 --overlap-param-gather=0 --pipeline-model-parallel-size=1
--position-embedding-type=1 --recompute-activations=0 --recompute-granularity=1 --recompute-method=1
--recompute-modules=* --recompute-num-layers=1
--rotary-base=1 --rotary-interleaved=0 --rotary-percent=1 --use-rope-scaling=0 --rope-scaling-factor=1
--rotary-seq-len-interpolation-factor=1 --window-size=1 --window-attn-skip-freq=1
--pipeline-model-parallel-layout=1 --microbatch-group-size-per-virtual-pipeline-stage=1 --save=1 --save-interval=1 --seed=1 --seq-length=1
--sequence-parallel=0 --skip-train=0 --split=1 --swiglu=0 --tensor-model-parallel-size=1 --tensorboard-dir=1
--tensorboard-log-interval=1 --tensorboard-queue-size=1 --tokenizer-model=1 --tokenizer-type=1
--null-tokenizer-eod-id=1 --null-tokenizer-pad-id=1 --tiktoken-num-special-tokens=1 --tiktoken-pattern=1
--tokenizer-hf-no-include-special-tokens=0 --tokenizer-hf-include-special-tokens=0 --legacy-tokenizer=0
--train-iters=1 --train-samples=1 --untie-embeddings-and-output-weights=0 --use-distributed-optimizer=0
--use-rotary-position-embeddings=0 --vocab-file=1 --vocab-size=1 --wandb-entity=1 --wandb-exp-name=1
--wandb-project=1 --wandb-save-dir=1 --weight-decay=1 --fp16=0 --loss-scale=1 --initial-loss-scale=1
--min-loss-scale=1 --loss-scale-window=1 --hysteresis=1""",
    "expert_layout": """
--expert-tensor-parallel-size=1""",
    "deprecated": """
--batch-size=1 --checkpoint-activations=0 --model-parallel-size=1 --warmup=1""",
    "moe": """
--ep-overlap-early-attn-memory-release=0 --expert-model-parallel-size=1
--expert-tensor-parallel-num-weight-shards=1 --gtp-expert-remat-nccl-ub=0
--gtp-remat-nccl-ub=0 --gtp-remat-opt-in-modules=+ --gtp-remat-reduce-scatter-with-fp32-accumulation=0
--moe-apply-probs-on-input=0 --moe-aux-loss-coeff=+ --moe-combine-bwd-dtype=1 --moe-deepep-num-sms=1
--moe-dispatch-fwd-dtype=1 --moe-enable-deepep=0 --moe-enable-routing-replay=0
--moe-expert-capacity-factor=1 --moe-expert-rank-capacity-factor=1 --moe-ffn-hidden-size=1
--moe-flex-dispatcher-backend=1 --moe-flex-dispatcher-num-sms=1 --moe-grouped-gemm=0
--moe-hybridep-num-blocks-permute=1 --moe-hybridep-num-blocks-unpermute=1 --moe-hybridep-num-sms=1
--moe-hybridep-num-sms-preprocessing=1 --moe-hybridep-pad-uneven-dispatch-inputs=0 --moe-input-jitter-eps=1
--moe-latent-size=1 --moe-layer-freq=1 --moe-layer-recompute=0 --moe-mlp-glu-interleave-size=1
--moe-ncclep-zero-copy=0 --moe-pad-expert-input-to-capacity=0 --moe-pad-experts-for-cuda-graph-inference=0
--moe-paged-stash=0 --moe-paged-stash-buffer-size-factor-cpu=1 --moe-paged-stash-buffer-size-factor-cuda=1
--moe-paged-stash-page-size=1 --moe-per-layer-logging=0 --moe-permute-fusion=0
--moe-permute-fusion-into-hybridep=0 --moe-router-bias-update-rate=1 --moe-router-dtype=1
--moe-router-enable-expert-bias=0 --moe-router-force-biased=1 --moe-router-force-load-balancing=0
--moe-router-fusion=0 --moe-router-group-topk=1 --moe-router-load-balancing-type=+ --moe-router-num-groups=1
--moe-router-padding-for-fp8=0 --moe-router-padding-for-quantization=0 --moe-router-pre-softmax=0
--moe-router-quantile-balancing-ema=1 --moe-router-score-function=1 --moe-router-topk=1
--moe-router-topk-scaling-factor=1 --moe-routing-trace-capture-hidden-states=0
--moe-routing-trace-capture-logits=0 --moe-routing-trace-dump-weights=0
--moe-routing-trace-max-training-iters=1 --moe-routing-trace-path=1 --moe-shared-expert-gate=0
--moe-shared-expert-glu-interleave-size=1 --moe-shared-expert-intermediate-size=1
--moe-shared-expert-overlap=0 --moe-single-grouped-bias=0 --moe-single-grouped-weight=0
--moe-token-dispatcher-type=1 --moe-token-drop-policy=1 --moe-upcycling-granularity=1
--moe-use-grouped-tensor=0 --moe-use-upcycling=0 --moe-z-loss-coeff=1 --num-experts=1
--overlap-dispatch-backward-with-experts-wgrad=0 --overlap-moe-expert-parallel-comm=0
--use-grouped-gemm-for-dense-mlp=0 --use-grouped-gemm-for-shared-expert=0""",
    "mla": """
--cache-mla-latents=0 --kv-lora-rank=1 --mla-down-proj-fusion=0 --mscale=1 --mscale-all-dim=1
--multi-latent-attention=0 --q-lora-rank=1 --qk-head-dim=1 --qk-pos-emb-head-dim=1 --rotary-scaling-factor=1
--v-head-dim=1""",
    "hybrid": """
--disable-dsa-indexer-rotate-activation=0 --disable-dsa-indexer-scoring-relu=0
--disable-mamba-mem-eff-path=0 --dsa-indexer-head-dim=1 --dsa-indexer-k-norm-epsilon=1
--dsa-indexer-k-norm-fp32=0 --dsa-indexer-loss-coeff=1 --dsa-indexer-n-heads=1
--dsa-indexer-rope-interleaved=0 --dsa-indexer-skip-topk-offset=1 --dsa-indexer-topk=1
--dsa-indexer-topk-freq=1 --dsa-indexer-use-sparse-loss=0 --dsa-kernel-backend=1 --enable-mhc-connections=0
--experimental-attention-variant=1 --gdp-cutedsl-kernel=0 --gdp-num-chunk-states-to-recompute=1
--gdp-num-householder=1 --heterogeneous-layers-config-encoded-json=1 --heterogeneous-layers-config-path=1
--hybrid-context-parallel=0 --hybrid-layer-pattern=1 --hybrid-override-pattern=1 --is-hybrid-model=0
--linear-attention-freq=1 --linear-conv-kernel-dim=1 --linear-key-head-dim=1 --linear-num-key-heads=1
--linear-num-value-heads=1 --linear-value-head-dim=1 --mamba-head-dim=1
--mamba-inference-conv-states-dtype=1 --mamba-inference-ssm-states-dtype=1 --mamba-num-groups=1
--mamba-num-heads=1 --mamba-state-dim=1 --mamba-training-ssm-states-dtype=1 --mhc-init-gating-factor=1
--mhc-num-residual-streams=1 --mhc-recompute-layer-num=1 --mhc-sinkhorn-iterations=1
--mlp-chunks-for-training=1 --mtp-detach-heads=0 --mtp-hsm=0 --mtp-hybrid-override-pattern=1
--mtp-loss-scaling-factor=1 --mtp-num-layers=1 --mtp-standalone=0 --mtp-use-repeated-layer=0
--no-dsa-indexer-rotate-activation=0 --no-dsa-indexer-scoring-relu=0 --spec=* --yaml-cfg=1""",
    "attn_variant": """
--activation-func-clamp-value=1 --apply-residual-connection-post-layernorm=0 --attention-output-gate=0
--mrope-section=+ --no-rope-freq=1 --no-yarn-correction-range-round-to-int=0 --qk-clip=0 --qk-clip-alpha=1
--qk-clip-threshold=1 --qk-l2-norm=0 --relative-attention-max-distance=1
--relative-attention-num-buckets=1 --rope-type=1
--softmax-type=1
--yarn-beta-fast=1 --yarn-beta-slow=1 --yarn-correction-range-round-to-int=0
--yarn-original-max-position-embeddings=1""",
    "megatron_fails": """
--init-method-xavier-uniform=0""",
    "activation": """
--openai-gelu=0 --quick-geglu=0 --use-fused-weighted-squared-relu=0""",
    "init": """
--freeze-all-layers=0
--mup-attn-scale-power=1 --mup-base-head-dim=1 --mup-base-hidden-size=1
--mup-embedding-mult=1 --mup-output-mult=1 --mup-width-mult=1 --no-initialization=0 --use-mup=0""",
    "optimizer": """
--apply-wd-to-qk-layernorm=0 --lion-beta1=1 --lion-beta2=1 --muon-coefficient-type=1
--muon-extra-scale-factor=1 --muon-fp32-matmul-prec=1 --muon-momentum=1 --muon-nesterov=0
--muon-no-split-qkv=0 --muon-num-ns-steps=1 --muon-scalar-optimizer=1 --muon-scale-mode=1 --muon-tp-mode=1
--muon-use-syrk=0 --no-weight-decay-cond-type=1 --phase-transition-iterations=1
--sgd-momentum=1""",
    "data": """
--allow-ambiguous-pad-tokens=0 --dataloader-inter-document-masking=0
--fim-data=0 --fim-eod-token=1 --fim-fragment-rate=1 --fim-middle-token=1 --fim-no-prefix=1
--fim-pad-token=1 --fim-prefix-token=1 --fim-rate=1 --fim-split-sample=1 --fim-spm-rate=1
--fim-suffix-token=1 --per-dataset-sequences-path=1
--reset-attention-mask=0 --sft=0 --sft-tokenizer-prompt-format=1""",
    "tokenizer": """
--chat-template=1 --disable-pad-vocab-size=0 --disable-tokenizer-sentencepiece-ignore-extra-whitespaces=0
--no-pad-vocab-size=0 --no-tokenizer-sentencepiece-ignore-extra-whitespaces=0
--tokenizer-hf-no-use-fast=0 --tokenizer-metadata=1 --tokenizer-sentencepiece-legacy=0
--tokenizer-special-tokens=+ --trust-remote-code=0 --use-gigatoken=0 --vocab-extra-ids=1""",
    "kitchen": """
--kitchen-config-file=1 --kitchen-recipe-number=1""",
    "modelopt": """
--enable-gpt-oss=0 --export-default-te-spec=0 --export-force-local-attention=0 --export-kd-cfg=1
--export-kd-teacher-ckpt-format=1 --export-kd-teacher-load=1 --export-kd-teacher-model-config=1
--export-kv-cache-quant=1 --export-legacy-megatron=0 --export-model-type=1 --export-moe-apply-probs-on-input=0
--export-offline-model=0 --export-qk-l2-norm=0 --export-quant-cfg=1 --export-real-quant-cfg=1
--export-te-mcore-model=0 --finetune-data-files=+ --finetune-data-split=1 --finetune-hf-dataset=1
--freeze-base-for-mtp=0 --modelopt-enabled=0 --qad-train-target=1""",
    "distill": """
--logits-load-decode-threads=1 --logits-load-dir=1 --logits-load-ignore-errors=0
--logits-load-kd-loss-alpha=1 --logits-load-msc-prefetch-depth=1 --logits-load-prefetch-factor=1
--logits-save-dir=1 --logits-save-dtype=1 --logits-save-top-k=1 --logits-save-top-p=1
--logits-save-top-p-min-k=1 --perform-rl-step=0""",
    "ckpt_load": """
--ckpt-convert-format=1 --ckpt-convert-save=1 --ckpt-convert-update-legacy-dist-opt-format=0
--disable-strict-fsdp-dtensor-load=0 --load-main-params-from-ckpt=0 --no-strict-fsdp-dtensor-load=0
--override-ckpt-iteration=1""",
    "seq_model": """
--decoder-num-layers=1 --encoder-num-layers=1 --encoder-seq-length=1""",
    "other_model": """
--batch-invariant-backend=1 --batch-invariant-mode=0 --bert-embedder-type=1 --bert-load=1
--bert-no-binary-head=0 --biencoder-projection-dim=1 --biencoder-shared-query-context-model=0
--block-data-path=1 --classes-fraction=1 --data-per-class-fraction=1 --decode-only-cuda-graphs=0
--decoder-seq-length=1 --dino-bottleneck-size=1 --dino-freeze-last-layer=1 --dino-head-hidden-size=1
--dino-local-crops-number=1 --dino-local-img-size=1 --dino-norm-last-layer=0 --dino-teacher-temp=1
--dino-warmup-teacher-temp=1 --dino-warmup-teacher-temp-epochs=1 --embedding-path=1
--enable-chunked-prefill=0 --evidence-data-path=1 --flash-decode=0 --grpo-clamp-eps-lower=1
--grpo-clamp-eps-upper=1 --grpo-entropy-term-weight=1 --grpo-filter-groups-with-same-reward=0
--grpo-group-size=1 --grpo-iterations=1 --grpo-kl-beta=1 --grpo-prompts-per-step=1 --head-lr-mult=1
--ict-head-size=1 --ict-load=1 --img-h=1 --img-w=1 --indexer-batch-size=1 --indexer-log-interval=1
--inference-batch-times-seqlen-threshold=1 --inference-coordinator-port=1
--inference-cuda-graph-all-prefills=0 --inference-cuda-graph-max-tokens=1 --inference-cuda-graph-scope=1
--inference-disable-ep-consensus=0 --inference-disable-triton-nvls-kernels=0 --inference-dynamic-batching=0
--inference-dynamic-batching-async-sched-mode=1 --inference-dynamic-batching-block-size=1
--inference-dynamic-batching-buffer-size-gb=1 --inference-dynamic-batching-cuda-graph-mixed-prefill-count=1
--inference-dynamic-batching-cuda-graph-sizing-distribution=1 --inference-dynamic-batching-logprobs-mode=1
--inference-dynamic-batching-mamba-memory-ratio=1 --inference-dynamic-batching-max-requests=1
--inference-dynamic-batching-max-tokens=1 --inference-dynamic-batching-num-cuda-graphs=1
--inference-dynamic-batching-paused-buffer-size-gb=1 --inference-dynamic-batching-prefix-caching=0
--inference-dynamic-batching-prefix-caching-coordinator-policy=1
--inference-dynamic-batching-prefix-caching-eviction-policy=1
--inference-dynamic-batching-prefix-caching-mamba-gb=1
--inference-dynamic-batching-prefix-caching-routing-alpha=1 --inference-dynamic-batching-sampling-backend=1
--inference-dynamic-batching-track-generated-token-events=0
--inference-dynamic-batching-track-paused-request-events=0
--inference-dynamic-batching-unified-memory-level=1 --inference-fuse-tp-communication=0
--inference-grouped-gemm-backend=1 --inference-logging-step-interval=1 --inference-max-requests=1
--inference-max-seq-length=1 --inference-moe-disable-fused-quant-kernels=0
--inference-moe-token-dispatcher-type=1 --inference-rng-tracker=0 --inference-shards=1
--inference-text-gen-server-logging=0 --inference-use-synchronous-zmq-collectives=0
--inference-wandb-logging=0 --iter-per-epoch=1 --langrl-env-config=1 --mask-factor=1 --mask-prob=1
--mask-type=1 --max-tokens-to-oom=1 --mlp-chunks-for-prefill=1 --nccl-all-reduce-for-prefill=0
--no-inference-disable-ep-consensus=0 --no-inference-dynamic-batching-prefix-caching=0
--no-inference-text-gen-server-logging=0 --no-inference-use-synchronous-zmq-collectives=0
--no-inference-wandb-logging=0 --no-rl-inference-logprobs-is-correction=0
--no-rl-offload-inference-model-weights-when-idle=0 --no-rl-partial-rollouts=0 --no-rl-persist-cuda-graphs=0
--no-rl-skip-bos-token=0 --no-rl-training-cuda-graphs=0 --no-rl-use-sequence-packing=0
--no-rl-verify-model-weights-swap=0 --num-channels=1 --num-classes=1 --num-speculative-tokens=1
--output-bert-embeddings=0 --output-logit-dtype=1 --patch-dim=1 --query-in-block-prob=1 --refit-method=1
--retriever-report-topk-accuracies=+ --retriever-score-scaling=0 --rl-consumption-granularity=1
--rl-default-temperature=1 --rl-default-top-k=1 --rl-default-top-p=1 --rl-durable-rollout-bank=0
--rl-generation-lag=1 --rl-importance-sampling-truncation-coef=1 --rl-inference-expert-model-parallel-size=1
--rl-inference-expert-tensor-model-parallel-size=1 --rl-inference-logprobs-is-correction=0
--rl-inference-model-unified-memory-level=1 --rl-inference-parsers=*
--rl-inference-pipeline-model-parallel-size=1 --rl-inference-tensor-model-parallel-size=1
--rl-kv-cache-management-mode=1 --rl-max-inflight-requests=1
--rl-offload-inference-model-weights-when-idle=0 --rl-offload-optimizer-during-inference=0
--rl-partial-rollouts=0 --rl-persist-cuda-graphs=0 --rl-profile=0 --rl-profile-dir=1 --rl-prompts-per-eval=1
--rl-rollout-bank-dir=1 --rl-rollout-bank-max-bytes=1 --rl-sequence-packing-algo=1
--rl-sequence-packing-max-sequences-per-bin=1 --rl-skip-bos-token=0 --rl-submission-granularity=1
--rl-training-cuda-graphs=0 --rl-use-sequence-packing=0 --rl-verify-model-weights-swap=0 --sample-rate=1
--short-seq-prob=1 --swin-backbone-type=1
--titles-data-path=1 --use-legacy-static-engine=0 --use-one-sent-docs=0
--use-same-sampling-seed-across-dp-ranks=0 --vision-backbone-type=1 --vision-pretraining=0
--vision-pretraining-type=1""",
    "fusion": """
--cross-entropy-fusion-impl=1 --cross-entropy-loss-fusion=0 --disable-jit-fuser=0 --fused-residual-rmsnorm=0
--no-bias-dropout-fusion=0 --no-bias-gelu-fusion=0 --no-bias-swiglu-fusion=0
--no-gradient-accumulation-fusion=0 --no-gradient-reduce-div-fusion=0 --no-masked-softmax-fusion=0
--no-persist-layer-norm=0 --no-rope-fusion=0 --use-te-activation-func=0 --use-transformer-engine-op-fuser=0""",
    "attention_backend": """
--apply-query-key-layer-scaling=0 --attention-backend=1 --attention-softmax-in-fp32=0
--disable-bf16-reduced-precision-matmul=0 --flash-attention-version=1 --kitchen-attention-backend=1
--onnx-safe=1 --transformer-impl=1 --use-flash-attn=0 --use-kitchen-attention=0 --use-mcore-models=0""",
    "precision": """
--accumulate-allreduce-grads-in-fp32=0 --disable-fp8-wgrad=0 --exp-avg-dtype=1 --exp-avg-sq-dtype=1
--first-last-layers-bf16=0 --fp16-lm-cross-entropy=0 --fp32-residual-connection=0 --fp4-format=1
--fp4-param-gather=0 --fp4-quantizer-factory=1 --fp4-recipe=1 --fp8-amax-compute-algo=1
--fp8-amax-history-len=1 --fp8-format=1 --fp8-interval=1 --fp8-margin=1 --fp8-output-proj=0
--fp8-param-gather=0 --fp8-quantizer-factory=1 --fp8-recipe=1 --grad-reduce-in-bf16=0
--keep-fp8-transpose-cache=0
--main-grads-dtype=1 --main-params-dtype=1 --no-fp8-wgrad=0 --num-layers-at-end-in-bf16=1
--num-layers-at-start-in-bf16=1 --reuse-grad-buf-for-mxfp8-param-ag=0 --te-precision-config-file=1""",
    "comm_overlap": """
--cp-comm-type=+
--create-all-gather-group=0 --ddp-average-in-collective=0 --ddp-bucket-size=1 --ddp-num-buckets=1
--ddp-pad-buckets-for-high-nccl-busbw=0 --ddp-param-name-patterns-for-fp32-local-accumulation=+
--ddp-reduce-scatter-with-fp32-accumulation=0 --defer-embedding-wgrad-compute=0 --delay-wgrad-compute=0
--disable-align-grad-reduce=0 --disable-clone-scatter-output-in-embedding=0 --disable-gloo-process-groups=0
--disable-symmetric-registration=0 --disable-tp-comm-bulk-dgrad=0 --disable-tp-comm-bulk-wgrad=0
--disable-tp-comm-overlap-ag=0 --disable-tp-comm-overlap-rs=0 --disable-tp-comm-split-ag=0
--disable-tp-comm-split-rs=0 --fake-process-group=0 --hierarchical-context-parallel-sizes=+
--high-priority-a2a-comm-stream=0 --high-priority-stream-groups=+ --lazy-mpu-init=0 --local-rank=1
--max-seqlen-per-dp-cp-rank=1
--nccl-communicator-config-path=1 --no-align-grad-reduce=0 --no-align-param-gather=0
--no-clone-scatter-output-in-embedding=0 --no-overlap-p2p-communication=0 --no-tp-comm-bulk-dgrad=0
--no-tp-comm-bulk-wgrad=0 --no-tp-comm-overlap-ag=0 --no-tp-comm-overlap-rs=0 --no-tp-comm-split-ag=0
--no-tp-comm-split-rs=0 --overlap-p2p-communication-warmup-flush=0
--overlap-param-gather-with-optimizer-step=0 --pipeline-model-parallel-comm-backend=1
--sharp-enabled-group=1 --suggested-communication-unit-size=1
--symmetric-ar-type=1 --tensor-parallel-num-weight-shards=1 --tp-comm-bootstrap-backend=1
--tp-comm-overlap=0 --tp-comm-overlap-cfg=1 --tp-comm-overlap-rs-dgrad=0 --use-nccl-ub=0
--use-ring-exchange-p2p=0 --use-sharp=0 --use-tp-pp-dp-mapping=0 --wgrad-deferral-limit=1""",
    "fsdp": """
--enable-full-sharding-in-hsdp=0
--fsdp-db-use-persist-buf-on-alloc-fail=0 --fsdp-double-buffer=0 --fsdp-manual-registration=0
--init-model-with-meta-device=0 --megatron-fsdp-enable-fine-grained-param-gather=0
--megatron-fsdp-grad-comm-dtype=1 --megatron-fsdp-main-grads-dtype=1 --megatron-fsdp-main-params-dtype=1
--megatron-fsdp-max-pool-double-buffer=0 --megatron-fsdp-version=1 --no-use-layer-wise-param-layout=0
--num-distributed-optimizer-instances=1 --outer-dp-sharding-strategy=1
--use-cpu-initialization=0""",
    "torch_fsdp2": """
--torch-fsdp2-no-reshard-after-forward=0 --use-torch-fsdp2=0""",
    "megatron_fsdp": """
--data-parallel-sharding-strategy=1 --use-megatron-fsdp=0""",
    "cuda_graphs": """
--cuda-graph-impl=1 --cuda-graph-modules=+ --cuda-graph-scope=+ --cuda-graph-warmup-steps=1
--enable-cuda-graph=0 --external-cuda-graph=0 --optimizer-cuda-graph=0 --te-rng-tracker=0""",
    "megatron_offload": """
--activation-offload-fraction=1 --cpu-offloading-num-layers=1 --delta-offload-bytes-across-pp-ranks=1
--fine-grained-activation-offloading=0 --min-offloaded-tensor-size=1 --offload-modules=+""",
    "megatron_offload_tuning": """
--cpu-offloading-retain-pinned-cpu-buffers=0 --delay-offload-until-cuda-graph=0
--fine-grained-offloading-max-inflight-offloads=1""",
    "distribute_saved": "--distribute-saved-activations=0",
    "param_group_dump": "--dump-param-to-param-group-map=1",
    "optimizer_offload": """
--no-pin-cpu-grads=0 --no-pin-cpu-params=0 --optimizer-cpu-offload=0 --optimizer-offload-fraction=1
--overlap-cpu-optimizer-d2h-h2d=0 --use-precision-aware-optimizer=0 --use-torch-optimizer-for-cpu-offload=0""",
    "profiling": """
--app-tag-run-name=1 --app-tag-run-version=1 --config-logger-dir=1 --disable-straggler-on-startup=0
--log-device-memory-used=0 --log-energy=0 --log-max-attention-logit=0 --log-memory-interval=1
--log-progress=0 --test-mode=0 --log-straggler=0 --logging-level=1
--memory-snapshot-path=1 --no-barrier-with-level-1-timing=0 --no-one-logger=0 --nvtx-ranges=0
--one-logger-async=0 --one-logger-project=1 --one-logger-run-name=1 --otel-enabled=0 --otel-service-name=1
--otel-span-groups=1 --profile=0 --profile-ranks=+ --profile-step-end=1 --profile-step-start=1
--pytorch-profiler-collect-callstack=0 --pytorch-profiler-collect-chakra=0
--pytorch-profiler-collect-shapes=0 --record-memory-history=0 --record-shapes=0
--run-workload-inspector-server=0 --save-activations-interval=1 --save-dgrads-interval=1
--save-params-interval=1 --save-tokens-per-expert-interval=1 --save-wgrads-interval=1
--straggler-ctrlr-port=1 --straggler-minmax-count=1 --timing-log-level=1 --timing-log-option=1
--use-pytorch-profiler=0""",
    "memory_mgmt": """
--disable-manual-gc-eval=0 --empty-unused-memory-level=1 --manual-gc=0 --manual-gc-interval=1
--no-manual-gc-eval=0""",
    "data_loading": """
--dataloader-defer-npy-index-mmap=0 --dataloader-fast-cache-load=0 --disable-msc=0 --enable-msc=0
--exit-signal-handler-for-dataloader=0 --mid-level-dataset-surplus=1
--no-create-attention-mask-in-dataloader=0 --no-mmap-bin-files=0 --num-dataset-builder-threads=1
--num-workers=1 --object-storage-cache-path=1""",
    "resilience": """
--adlr-autoresume=0 --adlr-autoresume-interval=1 --calc-ft-timeouts=0 --check-for-large-grads=0
--check-for-spiky-loss=0 --deterministic-mode=0
--disable-flight-recorder-dump-on-timeout=0 --disable-flight-recorder-extra-dump-on-exec=0
--disable-flight-recorder-include-only-active=0 --distributed-timeout-seconds-after-init=1
--enable-experimental=0 --enable-ft-package=0 --error-injection-rate=1 --error-injection-type=1
--exit-signal-handler-for-training=0 --fault-injector-delay-start-iteration=1 --fault-injector-fault-delay=1
--fault-injector-fault-probabilities=1 --fault-injector-fault-types=1 --fault-injector-mtti-seconds=1
--fault-injector-num-ranks=1 --fault-injector-offset-seconds=1 --fault-injector-ranks=1
--fault-injector-seed=1 --flight-recorder-dump-path=1 --flight-recorder-include-stack-trace=0
--flight-recorder-trace-buffer-size=1 --ft-num-warmup-iters=1 --gpu-sniff-test-interval=1
--inprocess-active-world-size=1 --inprocess-barrier-timeout=1 --inprocess-completion-timeout=1
--inprocess-empty-cuda-cache=0 --inprocess-granularity=1 --inprocess-hard-timeout=1
--inprocess-heartbeat-interval=1 --inprocess-heartbeat-timeout=1 --inprocess-last-call-wait=1
--inprocess-max-iterations=1 --inprocess-monitor-process-interval=1 --inprocess-monitor-thread-interval=1
--inprocess-progress-watchdog-interval=1 --inprocess-restart=0 --inprocess-soft-timeout=1
--inprocess-termination-grace-time=1 --no-flight-recorder-dump-on-timeout=0
--no-flight-recorder-extra-dump-on-exec=0 --no-flight-recorder-include-only-active=0
--result-rejected-tracker-filename=1 --train-sync-interval=1""",
    "sdc_guards": """
--check-weight-hash-across-dp-replicas-interval=1 --rerun-mode=1""",
    "ckpt_io": """
--async-ckpt-cpu-priority=1 --async-ckpt-io-priority=1 --async-ckpt-use-cpu-shm=0 --async-strategy=1
--auto-detect-ckpt-format=0 --ckpt-assume-constant-structure=0 --ckpt-drop-redundant-extra-state=0
--ckpt-fully-parallel-load=0 --ckpt-fully-parallel-load-exchange-algo=1
--ckpt-fully-parallel-load-per-rank-objects=0 --ckpt-fully-parallel-load-process-group=1
--ckpt-fully-parallel-save=0 --ckpt-fully-parallel-save-process-group=1 --ckpt-pg-tensors-cache-create=0
--ckpt-pg-tensors-cache-path=1 --disable-ckpt-load-validate-sharding-integrity=0
--disable-save-tokenizer-assets=0 --dist-ckpt-format=1 --dist-ckpt-optim-fully-reshardable=0
--dist-ckpt-save-pre-mcore-014=0 --dist-ckpt-strictness=1 --dist-ckpt-workers=1
--distrib-optim-fully-reshardable-mem-efficient=0
--no-ckpt-fully-parallel-save=0 --no-ckpt-load-validate-sharding-integrity=0
--no-save-tokenizer-assets=0 --non-persistent-ckpt-type=1 --non-persistent-global-ckpt-dir=1
--non-persistent-local-ckpt-algo=1 --non-persistent-local-ckpt-dir=1 --non-persistent-save-interval=1
--persistent-save-interval=1
--replication=0 --replication-factor=1 --replication-jump=1 --save-retain-interval=1
--use-dist-ckpt=0
--use-persistent-ckpt-worker=0 --verify-integrity=0""",
    "eval_extra": """
--full-validation=0 --multiple-validation-sets=0 --validation-set-names=+""",
}

# Megatron-Kwai's flags that Megatron-LM does not have (KWAI_SOURCE)
MEGATRON_KWAI: dict[str, str] = {
    "data_loading": "--kaimm-async-dataloader=0 --prefetch-factor=1",
    "kaimm_cp": "--kaimm-cp-offload-mode=1 --kaimm-overlap-cp-slow-ctas=1",
    "kaimm_sync": "--kaimm-cuda-synchronize-level=1",
    "memory_mgmt": "--kaimm-gc-interval=1",
    "implemented": "--kaimm-offload-activation-ratio=1 --kaimm-recompute-mlp-activation-func=0 --kaimm-recompute-norm=0 --overlap-p2p-communication=0 --pipeline-parallel-aware-offloading-ratio=1 --rms-norm=0",
    "profiling": "--kaimm-profile-analysis=0",
    "kaimm_warmup": "--kaimm-warmup-iters=1",
    "comm_overlap": "--no-context-parallel-comm-overlap-gemm=0 --overlap-sp-ag=0 --overlap-sp-rs=0",
    "attention_backend": "--no-query-key-layer-scaling=0",
    "fusion": "--use-fast-rms-norm=0 --use-fast-rope=0",
}


__all__ = ["KWAI_SOURCE", "MEGATRON_KWAI", "MEGATRON_LM", "MEGATRON_LM_SOURCE", "REASONS", "Reason"]
