"""The flag sets of real Megatron-LM and Megatron-Kwai run scripts, copied as data with their sources.

Each list is the script's flags as its launcher passes them (shell variables expanded with the
script's own values); :func:`shrink` changes only model size, run length, data paths and parallel sizes.
"""
from __future__ import annotations

# https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/examples/gpt3/train_gpt3_175b_distributed.sh
GPT3_175B = [
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
    "--max-position-embeddings", "2048", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "1536",
    "--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536",
    "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
    "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
    "--data-path", "$DATA_PATH", "--vocab-file", "$VOCAB_FILE", "--merge-file", "$MERGE_FILE", "--split", "949,50,1",
    "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--save", "$CHECKPOINT_PATH",
    "--load", "$CHECKPOINT_PATH", "--eval-iters", "10", "--tensorboard-dir", "$TENSORBOARD_LOGS_PATH",
]

# https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/examples/llama/train_llama3_8b_h100_fp8.sh
# (DTYPE=fp8, the MOCK data branch; its array elements such as "--split '99,1,0'" reach the program word-split,
# quotes included, as they do there)
LLAMA3_8B_FP8 = [
    "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128",
    "--seq-length", "8192", "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--swiglu", "--normalization", "RMSNorm", "--init-method-std", "0.0134", "--attention-backend", "fused",
    "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
    "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015", "--min-lr", "0.00001",
    "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
    "--exit-duration-in-mins", "235", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max", "--fp8-param-gather",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--data-cache-path",
    "$DATA_CACHE_PATH", "--tiktoken-pattern", "v2", "--split", "'99,1,0'", "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files", "--num-workers", "1",
    "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
    "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
    "torch_dist", "--distributed-timeout-minutes", "60", "--save", "$CHECKPOINT_PATH", "--load", "$CHECKPOINT_PATH",
    "--tensorboard-dir", "$TENSORBOARD_LOGS_PATH",
]


# https://github.com/kwai/Megatron-Kwai/blob/b2646e4d9f244b90de44352ac742a1494a4781cc/examples/atc24/pretrain_llama.sh
# with the environment of examples/atc24/llama-7b and 2_run_7b_4gpus_ours.sh (CKPT=ours, OFFLOAD_ALPHA=0.10,
# TP=1 CP=1 PP=4, GQA=0) or 1_run_7b_4gpus_baseline.sh (CKPT=full, OFFLOAD_ALPHA=0.0, PP=1)
def kwai_pretrain_llama(ckpt: str, alpha: str, tp: str, pp: str, cp: str = "1") -> list[str]:
    ckpt_args = {"full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "1"],
                 "ours": ["--kaimm-recompute-mlp-activation-func", "--kaimm-recompute-norm"], "no": []}[ckpt]
    return [
        "--use-distributed-optimizer", "--accumulate-allreduce-grads-in-fp32", "--initial-loss-scale", "1",
        "--use-flash-attn", "--tensor-model-parallel-size", tp, "--sequence-parallel",
        "--pipeline-model-parallel-size", pp, "--context-parallel-size", cp, *ckpt_args,
        "--overlap-sp-ag", "--overlap-sp-rs", "--kaimm-overlap-cp-slow-ctas", "4", "--kaimm-cuda-synchronize-level", "2",
        "--kaimm-gc-interval", "9999", "--use-fast-rms-norm", "--use-fast-rope",
        "--kaimm-offload-activation-ratio", alpha, "--kaimm-async-dataloader", "--prefetch-factor", "64",
        "--num-layers", "14", "--hidden-size", "4096", "--num-attention-heads", "32", "--ffn-hidden-size", "11008",
        "--seq-length", "12288", "--max-position-embeddings", "12288", "--micro-batch-size", "1",
        "--global-batch-size", "16", "--lr", "1.5e-4", "--train-iters", "200", "--lr-decay-iters", "500000",
        "--lr-decay-style", "cosine", "--min-lr", "1.5e-5", "--weight-decay", "0.1", "--lr-warmup-iters", "2000",
        "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-5", "--bf16",
        "--no-position-embedding", "--use-rotary-position-embeddings", "--swiglu", "--rms-norm",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0.",
        "--attention-dropout", "0.", "--no-query-key-layer-scaling", "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
        "--data-path", "$DATA_PATH", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32004", "--split", "949,50,1",
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "0",
    ]


def shrink(flags: list[str], values: dict[str, str], drop: tuple[str, ...] = ()) -> list[str]:
    """``flags`` with the values of the flags in ``values`` replaced (``$VARS`` expanded) and the flags in
    ``drop`` (with their values) removed; every replaced flag must be present."""
    out, seen, i = [], set(), 0
    while i < len(flags):
        f = flags[i]
        takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if f in drop:
            i += 2 if takes_value else 1
            continue
        out.append(f)
        if f in values:
            assert takes_value, f
            out.append(values[f])
            seen.add(f)
            i += 2
            continue
        i += 1
    assert seen == set(values), set(values) - seen
    return out


def script_flags(flags: list[str]) -> list[str]:
    """The flag names of a flag list."""
    return [f for f in flags if f.startswith("--")]
