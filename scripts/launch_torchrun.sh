#!/usr/bin/env bash
# Launch pretrain_llama.py (or ENTRY=pretrain_gpt.py) on one node (or one node of several) with torchrun.
#
#   NPROC_PER_NODE=4 scripts/launch_torchrun.sh --num-layers 32 ... [--dry-run]
#
# Environment (defaults): NPROC_PER_NODE=2, NNODES=1, NODE_RANK=0, MASTER_ADDR=127.0.0.1,
# MASTER_PORT=29500, PYTHON (the repo's .venv python if present, else python3), ENTRY=pretrain_llama.py
# (pretrain_gpt.py: Megatron-LM's entry name and defaults).
# Every argument except --dry-run goes to the entry; --dry-run prints the command instead.
# The flags are checked once (h3t_training.launch.preflight) before any rank starts.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY_RUN=0
ARGS=()
for a in "$@"; do
  if [[ $a == --dry-run ]]; then DRY_RUN=1; else ARGS+=("$a"); fi
done
if [[ -x $ROOT/.venv/bin/python ]]; then DEFAULT_PYTHON=$ROOT/.venv/bin/python; else DEFAULT_PYTHON=python3; fi
PYTHON=${PYTHON:-$DEFAULT_PYTHON}
ENTRY=${ENTRY:-pretrain_llama.py}
case $ENTRY in
  pretrain_llama.py | pretrain_gpt.py) ;;
  *) echo "launch_torchrun.sh: error: ENTRY=$ENTRY is not one of pretrain_llama.py, pretrain_gpt.py" >&2; exit 2 ;;
esac
NPROC_PER_NODE=${NPROC_PER_NODE:-2}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
# torchrun through h3t_training.launch.torchrun: the same launcher, ending with status 130 and no traceback on Ctrl-C
CMD=("$PYTHON" -m h3t_training.launch.torchrun
     --nproc-per-node "$NPROC_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
     --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
     "$ROOT/$ENTRY" "${ARGS[@]}")
if [[ $DRY_RUN == 1 ]]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
# Check the flags once for the whole world before any rank starts (one line and exit 2 when bad).
(cd "$ROOT" && "$PYTHON" -m h3t_training.launch.preflight --world-size "$((NPROC_PER_NODE * NNODES))" --entry "$ENTRY" \
  --ranks-per-node "$NPROC_PER_NODE" -- "${ARGS[@]}") || exit $?
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's h3t_training, wherever it is started from
exec "${CMD[@]}"
