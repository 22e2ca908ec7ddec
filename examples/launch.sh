#!/usr/bin/env bash
# Sourced by the example scripts: run pretrain_llama.py through the launcher named by LAUNCHER
# (torchrun, mpirun or slurm). Arguments go through unchanged; --dry-run prints the command.
# With LAUNCHER=slurm the job is submitted with sbatch (NNODES nodes of GPUS_PER_NODE GPUs);
# with --dry-run the template prints the srun command it would run.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

launch() {
  local launcher=${LAUNCHER:-torchrun} dry=0 a
  for a in "$@"; do [[ $a == --dry-run ]] && dry=1; done
  case $launcher in
    torchrun) bash "$ROOT/scripts/launch_torchrun.sh" "$@" ;;
    mpirun) bash "$ROOT/scripts/launch_mpirun.sh" "$@" ;;
    slurm)
      if [[ $dry == 1 ]]; then
        SLURM_JOB_NUM_NODES=${NNODES:-1} bash "$ROOT/scripts/launch_slurm.sbatch" "$@"
      else
        sbatch --nodes "${NNODES:-1}" --ntasks-per-node "${GPUS_PER_NODE:-8}" --gpus-per-node "${GPUS_PER_NODE:-8}" \
          "$ROOT/scripts/launch_slurm.sbatch" "$@"
      fi ;;
    *) echo "launch.sh: error: LAUNCHER=$launcher is not one of torchrun, mpirun, slurm" >&2; return 2 ;;
  esac
}
