#!/usr/bin/env bash
# Launch pretrain_llama.py (or ENTRY=pretrain_gpt.py) with OpenMPI's mpirun; each rank maps OpenMPI's
# variables to torch's.
#
#   NP=16 HOSTFILE=hosts scripts/launch_mpirun.sh --num-layers 32 ... [--dry-run]
#
# Environment (defaults): NP=2 (ranks), HOSTFILE (none: this node), MASTER_ADDR (first host of
# HOSTFILE, else 127.0.0.1), MASTER_PORT=29500, MPIRUN=mpirun, PYTHON, MPI_EXTRA_ARGS (extra
# mpirun arguments, e.g. "--oversubscribe"), ENTRY=pretrain_llama.py (pretrain_gpt.py: Megatron-LM's entry
# name and defaults), CUDA_DEVICE_MAX_CONNECTIONS (passed to every rank when set). As root,
# --allow-run-as-root is added.
# Inside each rank: RANK=OMPI_COMM_WORLD_RANK, WORLD_SIZE=OMPI_COMM_WORLD_SIZE,
# LOCAL_RANK=OMPI_COMM_WORLD_LOCAL_RANK, LOCAL_WORLD_SIZE=OMPI_COMM_WORLD_LOCAL_SIZE.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -x $ROOT/.venv/bin/python ]]; then DEFAULT_PYTHON=$ROOT/.venv/bin/python; else DEFAULT_PYTHON=python3; fi
PYTHON=${PYTHON:-$DEFAULT_PYTHON}
ENTRY=${ENTRY:-pretrain_llama.py}
case $ENTRY in
  pretrain_llama.py | pretrain_gpt.py) ;;
  *) echo "launch_mpirun.sh: error: ENTRY=$ENTRY is not one of pretrain_llama.py, pretrain_gpt.py" >&2; exit 2 ;;
esac

if [[ ${H3T_MPI_RANK_WRAPPER:-0} == 1 ]]; then  # one rank, started by mpirun below
  export RANK=${OMPI_COMM_WORLD_RANK:?not started by OpenMPI mpirun}
  export WORLD_SIZE=${OMPI_COMM_WORLD_SIZE:?}
  export LOCAL_RANK=${OMPI_COMM_WORLD_LOCAL_RANK:-0}
  export LOCAL_WORLD_SIZE=${OMPI_COMM_WORLD_LOCAL_SIZE:-1}
  exec "$PYTHON" "$ROOT/$ENTRY" "$@"
fi

DRY_RUN=0
ARGS=()
for a in "$@"; do
  if [[ $a == --dry-run ]]; then DRY_RUN=1; else ARGS+=("$a"); fi
done
NP=${NP:-2}
HOSTFILE=${HOSTFILE:-}
MPIRUN=${MPIRUN:-mpirun}
if [[ -n $HOSTFILE ]]; then DEFAULT_ADDR=$(awk 'NF && $1 !~ /^#/ {print $1; exit}' "$HOSTFILE"); else DEFAULT_ADDR=127.0.0.1; fi
MASTER_ADDR=${MASTER_ADDR:-$DEFAULT_ADDR}
MASTER_PORT=${MASTER_PORT:-29500}
MPI_ARGS=(-np "$NP" --bind-to none --map-by slot)
[[ -n $HOSTFILE ]] && MPI_ARGS+=(--hostfile "$HOSTFILE")
[[ $(id -u) == 0 ]] && MPI_ARGS+=(--allow-run-as-root)
read -r -a EXTRA <<< "${MPI_EXTRA_ARGS:-}"
MPI_ARGS+=("${EXTRA[@]}")
MPI_ARGS+=(-x MASTER_ADDR="$MASTER_ADDR" -x MASTER_PORT="$MASTER_PORT" -x H3T_MPI_RANK_WRAPPER=1
           -x PYTHON="$PYTHON" -x ENTRY="$ENTRY" -x OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" -x PATH)
# the CUDA setting Megatron-LM asserts (the driver checks it on every rank): the ranks on other hosts see it too
[[ -n ${CUDA_DEVICE_MAX_CONNECTIONS+x} ]] && MPI_ARGS+=(-x CUDA_DEVICE_MAX_CONNECTIONS="$CUDA_DEVICE_MAX_CONNECTIONS")
CMD=("$MPIRUN" "${MPI_ARGS[@]}" bash "$ROOT/scripts/launch_mpirun.sh" "${ARGS[@]}")
if [[ $DRY_RUN == 1 ]]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
# Check the flags once for the whole world before any rank starts (one line and exit 2 when bad).
(cd "$ROOT" && "$PYTHON" -m h3t_training.launch.preflight --world-size "$NP" --entry "$ENTRY" -- "${ARGS[@]}") || exit $?
exec "${CMD[@]}"
