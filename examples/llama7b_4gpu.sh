#!/usr/bin/env bash
# The published 7B demo: Llama-7B, sequence 12288, 4 GPUs, pipeline 4 (l=1), global batch 16.
#
#   MODE=baseline examples/llama7b_4gpu.sh   # Megatron's full recompute
#   MODE=ours     examples/llama7b_4gpu.sh   # --ckpt ours --offload-alpha 0.1 (ALPHA)
#   MODE=nockpt   examples/llama7b_4gpu.sh   # --ckpt no, alpha from the cost model (ALPHA=auto)
#
# Environment (defaults): MODE=ours, ITERS=20, LAUNCHER=torchrun, NPROC_PER_NODE=4, DATA_ARGS
# (default --mock-data), GPU (cost-model system for MFU; default: detected).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"
MODE=${MODE:-ours}
ITERS=${ITERS:-20}
case $MODE in
  baseline) MEMORY=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
  ours) MEMORY=(--ckpt ours --offload-alpha "${ALPHA:-0.1}") ;;
  nockpt) MEMORY=(--ckpt no --offload-alpha "${ALPHA:-auto}") ;;
  *) echo "llama7b_4gpu.sh: error: MODE=$MODE is not one of baseline, ours, nockpt" >&2; exit 2 ;;
esac
MODEL=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008
       --seq-length 12288 --max-position-embeddings 12288 --bf16)
PARALLEL=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1
          --use-distributed-optimizer)
TRAIN=(--micro-batch-size 1 --global-batch-size 16 --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5
       --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0)
read -r -a DATA <<< "${DATA_ARGS:---mock-data --tokenizer-type NullTokenizer --vocab-size 32000}"
GPU_ARGS=()
[[ -n ${GPU:-} ]] && GPU_ARGS=(--gpu "$GPU")
NPROC_PER_NODE=${NPROC_PER_NODE:-4} NP=${NP:-4} \
  launch "${MODEL[@]}" "${PARALLEL[@]}" "${TRAIN[@]}" "${MEMORY[@]}" "${DATA[@]}" "${GPU_ARGS[@]}" \
  --log-interval 1 "$@"
