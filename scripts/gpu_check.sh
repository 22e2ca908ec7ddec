#!/usr/bin/env bash
# Everything that needs a GPU, in one command, on a machine with one NVIDIA GPU, PyTorch and no
# network: the `gpu` pytest tier, the per-stage memory check (two ranks on the GPU against the cost
# model), the offload-overlap, copy-kernel and attention-dropout benchmarks, and the cost model's ground truth
# (scripts/gpu/ground_truth.py, 420 s budget: its JSON lands beside the report); writes one JSON report under
# docs/gpu-reports/ and prints a short table.
#
#   bash scripts/gpu_check.sh [--dry-run]
#
# Environment (defaults): PYTHON (the repo's .venv python if present, else python3), WHEELS (a
# directory of wheels to install first with --no-index, e.g. megatron-core for this Python; with
# megatron-core 0.17+ the report also runs pretrain_gpt.py on Megatron's own training loop).
# Fails in one line when there is no GPU or a package is missing.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -x $ROOT/.venv/bin/python ]]; then DEFAULT_PYTHON=$ROOT/.venv/bin/python; else DEFAULT_PYTHON=python3; fi
PYTHON=${PYTHON:-$DEFAULT_PYTHON}
WHEELS=${WHEELS:-}
DRY_RUN=0
for a in "$@"; do
  if [[ $a == --dry-run ]]; then DRY_RUN=1; else echo "gpu_check.sh: error: unknown argument $a (valid: --dry-run)" >&2; exit 2; fi
done
die() { echo "gpu_check.sh: error: $*" >&2; exit 1; }

"$PYTHON" -c "import torch" 2>/dev/null || die "PyTorch is not importable by $PYTHON"
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || die "no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False); run this on a machine with one NVIDIA GPU"
if [[ -n $WHEELS ]]; then
  "$PYTHON" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || die "installing the wheels in $WHEELS failed"
fi
for mod in megatron.core pybind11 pytest; do
  "$PYTHON" -c "import $mod" 2>/dev/null || die "Python package '$mod' is missing: carry its wheel for this Python ($("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')) and pass WHEELS=DIR (e.g. pip download megatron-core==0.16.1 --no-deps --only-binary :all: --python-version 3.12 -d DIR on a machine with network)"
done
CMD=("$PYTHON" "$ROOT/scripts/gpu/report.py")
if [[ $DRY_RUN == 1 ]]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
# The CUDA copy kernels build where nvcc and a GPU are present.
(cd "$ROOT" && H3T_BUILD_CUDA=1 "$PYTHON" setup.py -q build_ext --inplace >/dev/null) \
  || die "building the native CUDA kernels failed (run: H3T_BUILD_CUDA=1 $PYTHON setup.py build_ext --inplace)"
cd "$ROOT"
exec "${CMD[@]}"
