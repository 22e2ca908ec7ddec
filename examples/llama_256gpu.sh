#!/usr/bin/env bash
# Large runs on 256 GPUs (32 nodes of 8): MODEL_NAME=llama-65b | llama2-70b | llama-175b.
#
# llama-65b uses the published best plan of the 256-GPU row (t=2, p=8, l=2, ckpt no, alpha 0.355);
# the others let the planner choose every parallel and memory flag (--auto-plan), which it prints.
# Extra flags override (e.g. --offload-alpha balanced). LAUNCHER=slurm (default) submits with
# sbatch; LAUNCHER=mpirun with HOSTFILE; --dry-run prints the command.
#
# Environment (defaults): MODEL_NAME=llama-65b, SEQ=4096, GBS=256, ITERS=20, NNODES=32,
# GPUS_PER_NODE=8, LAUNCHER=slurm, DATA_ARGS (--mock-data with a 32000-token vocabulary),
# CUDA_DEVICE_MAX_CONNECTIONS=1 (what Megatron-LM asserts for tensor parallelism before Blackwell; a plan with
# Megatron FSDP needs it unset: CUDA_DEVICE_MAX_CONNECTIONS= leaves it out).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"
MODEL_NAME=${MODEL_NAME:-llama-65b}
SEQ=${SEQ:-4096}
GBS=${GBS:-256}
ITERS=${ITERS:-20}
export NNODES=${NNODES:-32} GPUS_PER_NODE=${GPUS_PER_NODE:-8} LAUNCHER=${LAUNCHER:-slurm}
export NP=${NP:-$((NNODES * GPUS_PER_NODE))}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS-1}
[[ -z $CUDA_DEVICE_MAX_CONNECTIONS ]] && unset CUDA_DEVICE_MAX_CONNECTIONS
case $MODEL_NAME in
  llama-65b)
    MODEL=(--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --ffn-hidden-size 22016)
    PLAN=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 --num-layers-per-virtual-pipeline-stage 2
          --sequence-parallel --use-distributed-optimizer --micro-batch-size 1 --ckpt no --offload-alpha 0.355) ;;
  llama2-70b)
    MODEL=(--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention --num-query-groups 8
           --ffn-hidden-size 28672)
    PLAN=(--auto-plan) ;;
  llama-175b)
    MODEL=(--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --ffn-hidden-size 32768)
    PLAN=(--auto-plan) ;;
  *) echo "llama_256gpu.sh: error: MODEL_NAME=$MODEL_NAME is not one of llama-65b, llama2-70b, llama-175b" >&2
     exit 2 ;;
esac
TRAIN=(--seq-length "$SEQ" --max-position-embeddings "$SEQ" --global-batch-size "$GBS" --train-iters "$ITERS"
       --lr 1.5e-4 --min-lr 1.5e-5 --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --bf16 --gpu "${GPU:-h800}")
read -r -a DATA <<< "${DATA_ARGS:---mock-data --tokenizer-type NullTokenizer --vocab-size 32000}"
launch "${MODEL[@]}" "${PLAN[@]}" "${TRAIN[@]}" "${DATA[@]}" --log-interval 1 "$@"
