#!/usr/bin/env bash
# Installs a CUDA compiler (nvcc, its front end and headers, the runtime's headers and library) from NVIDIA's PyPI
# wheels into one folder, so that a machine without a GPU or a CUDA toolkit compiles csrc/copy_cuda.cu and
# csrc/bindings_cuda.cpp: tests/gpu/test_kernels_cuda.py's two compile checks then run instead of skipping. Nothing
# here runs a kernel; the GPU tests still need a GPU. Prints the folder's bin/ for PATH.
#
#   TOOLKIT=/tmp/h3t-cuda-toolkit PYTHON=python3 CUDA_WHEELS_VERSION=13.0 bash scripts/cuda_compiler.sh [--dry-run]
#   export PATH="$(bash scripts/cuda_compiler.sh | tail -1):$PATH"
set -euo pipefail

TOOLKIT=${TOOLKIT:-/tmp/h3t-cuda-toolkit}
PYTHON=${PYTHON:-python3}
# CUDA 13.0, the GPU machine's major version. The toolkit is split over five wheels; nvcc alone has no front end
# (nvvm's cicc) and no CRT headers.
CUDA_WHEELS_VERSION=${CUDA_WHEELS_VERSION:-13.0}
WHEELS=(nvidia-cuda-nvcc nvidia-cuda-crt nvidia-nvvm nvidia-cuda-runtime nvidia-cuda-cccl)
SPECS=()
for w in "${WHEELS[@]}"; do SPECS+=("${w}==${CUDA_WHEELS_VERSION}.*"); done
CMD=("${PYTHON}" -m pip --disable-pip-version-check -q install --no-deps --target "${TOOLKIT}" "${SPECS[@]}")
BIN=${TOOLKIT}/nvidia/cu${CUDA_WHEELS_VERSION%%.*}/bin

if [[ ${1:-} == "--dry-run" ]]; then
  printf '%q ' "${CMD[@]}"; echo
  echo "${BIN}"
  exit 0
fi
if [[ $# -gt 0 ]]; then
  echo "cuda_compiler.sh: error: unknown argument '$1' (the only one is --dry-run)" >&2
  exit 2
fi
if [[ ! -x ${BIN}/nvcc ]]; then
  "${CMD[@]}"
  # wheels do not keep the executable bit of the compiler's programs
  chmod +x "${BIN}"/* "${TOOLKIT}"/nvidia/cu*/nvvm/bin/* 2>/dev/null || true
fi
"${BIN}/nvcc" --version | tail -1 >&2
echo "${BIN}"
