#!/usr/bin/env bash
# The main CPU job: a small Llama on 2 CPU processes (gloo), pipeline 2 with interleaving (v=2),
# --ckpt ours --offload-alpha 0.5, trained on real text (the Python standard library's own
# documentation, generated on the spot). A few minutes on 2 cores; the loss falls.
#
#   examples/tiny_cpu.sh [--dry-run] [more pretrain_llama.py flags]
#
# Environment (defaults): NPROC=2, PP=2, LAYERS_PER_VSTAGE=1, ITERS=100, CKPT=ours, ALPHA=0.5,
# DATA_DIR=${TMPDIR:-/tmp}/h3t-tiny-cpu, METRICS_JSON=$DATA_DIR/metrics.json, LAUNCHER=torchrun.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"
if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=${PYTHON:-$ROOT/.venv/bin/python}; else PYTHON=${PYTHON:-python3}; fi
export PYTHON
NPROC=${NPROC:-2}
PP=${PP:-2}
LAYERS_PER_VSTAGE=${LAYERS_PER_VSTAGE:-1}
ITERS=${ITERS:-100}
CKPT=${CKPT:-ours}
ALPHA=${ALPHA:-0.5}
DATA_DIR=${DATA_DIR:-${TMPDIR:-/tmp}/h3t-tiny-cpu}
METRICS_JSON=${METRICS_JSON:-$DATA_DIR/metrics.json}
PREFIX=$DATA_DIR/stdlib_text_document

DRY=0
for a in "$@"; do [[ $a == --dry-run ]] && DRY=1; done
if [[ $DRY == 0 && ! -f $PREFIX.idx ]]; then
  mkdir -p "$DATA_DIR"
  "$PYTHON" "$ROOT/tools/make_stdlib_corpus.py" --output "$DATA_DIR/corpus.jsonl" --min-bytes 300000
  "$PYTHON" "$ROOT/tools/preprocess_data.py" --input "$DATA_DIR/corpus.jsonl" --output-prefix "$DATA_DIR/stdlib" \
    --tokenizer-type ByteTokenizer --append-eod
fi

MODEL=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2
       --ffn-hidden-size 352 --seq-length 128 --max-position-embeddings 128)
TRAIN=(--micro-batch-size 2 --global-batch-size 16 --train-iters "$ITERS" --lr 3e-3 --min-lr 3e-4
       --lr-warmup-iters 4 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --seed 1234)
PARALLEL=(--pipeline-model-parallel-size "$PP" --num-layers-per-virtual-pipeline-stage "$LAYERS_PER_VSTAGE")
MEMORY=(--ckpt "$CKPT" --offload-alpha "$ALPHA")
IO=(--data-path "$PREFIX" --split 100,0,0 --tokenizer-type ByteTokenizer --data-cache-path "$DATA_DIR/cache"
    --log-interval "${LOG_INTERVAL:-10}" --metrics-json "$METRICS_JSON")

NPROC_PER_NODE=$NPROC MASTER_PORT=${MASTER_PORT:-29531} NP=$NPROC \
  launch "${MODEL[@]}" "${TRAIN[@]}" "${PARALLEL[@]}" "${MEMORY[@]}" "${IO[@]}" "$@"
