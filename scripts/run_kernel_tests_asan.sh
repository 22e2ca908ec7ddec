#!/usr/bin/env bash
# Runs the kernel tests against an AddressSanitizer + UBSan build of the native CPU module
# and of its tensor front end (_copy_torch, built when torch's headers are found).
#
# The package, csrc/ and the kernel tests (tests/*/test_kernels*.py but the two below) are copied to a scratch directory, the
# extensions are compiled there with -fsanitize=address,undefined, and pytest runs from that
# copy with libasan preloaded (with libstdc++; python itself is not instrumented; leak checking is off
# because the interpreter and torch keep allocations alive at exit).
#
#   PYTHON=.venv/bin/python WORK=/tmp/h3t-asan scripts/run_kernel_tests_asan.sh [--dry-run] [pytest args...]
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-${REPO}/.venv/bin/python}
WORK=${WORK:-$(mktemp -d -t h3t-asan.XXXXXX)}
CXX=${CXX:-g++}
SANITIZE=${SANITIZE:-address,undefined}

DRY_RUN=0
PYTEST_ARGS=()
for arg in "$@"; do
  if [[ "${arg}" == "--dry-run" ]]; then DRY_RUN=1; else PYTEST_ARGS+=("${arg}"); fi
done

PY_INCLUDE=$("${PYTHON}" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
PYBIND_INCLUDE=$("${PYTHON}" -c "import pybind11; print(pybind11.get_include())")
EXT_SUFFIX=$("${PYTHON}" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
# libstdc++ is preloaded too: python does not link it, and ASan's __cxa_throw interceptor
# needs it present at start-up to resolve the real function.
LIBASAN="$("${CXX}" -print-file-name=libasan.so) $("${CXX}" -print-file-name=libstdc++.so)"

BUILD_CMD=("${CXX}" -O1 -g -std=c++17 -shared -fPIC -pthread "-fsanitize=${SANITIZE}" -fno-omit-frame-pointer
           -fno-sanitize-recover=all -I"${REPO}/csrc" -I"${PYBIND_INCLUDE}" -I"${PY_INCLUDE}"
           "${REPO}/csrc/bindings_cpu.cpp" "${REPO}/csrc/copy_cpu.cpp" "${REPO}/csrc/copy_plan.cpp"
           "${REPO}/csrc/host_alloc.cpp" -o "${WORK}/h3t_ext/kernels/_copy_cpu${EXT_SUFFIX}")
# The tensor front end: torch's include paths, C++ ABI and libraries (rpath to torch/lib).
read -r -a TORCH_FLAGS <<< "$("${PYTHON}" -c "
import os, torch
from torch.utils import cpp_extension as c
lib = os.path.join(os.path.dirname(torch.__file__), 'lib')
print(' '.join(['-I' + p for p in c.include_paths()] + ['-D_GLIBCXX_USE_CXX11_ABI=%d' % torch._C._GLIBCXX_USE_CXX11_ABI,
      '-L' + lib, '-Wl,-rpath,' + lib, '-lc10', '-ltorch', '-ltorch_cpu', '-ltorch_python']))")"
TORCH_BUILD_CMD=("${CXX}" -O1 -g -std=c++20 -shared -fPIC -pthread "-fsanitize=${SANITIZE}" -fno-omit-frame-pointer
                 -fno-sanitize-recover=all -I"${REPO}/csrc" -I"${PYBIND_INCLUDE}" -I"${PY_INCLUDE}"
                 "${REPO}/csrc/bindings_torch.cpp"
                 "${TORCH_FLAGS[@]}" -o "${WORK}/h3t_ext/kernels/_copy_torch${EXT_SUFFIX}")
# the kernel tests, in their tier folders (their paths to the repo count the folders); the two that compile
# their own C++ (tests/integration/test_kernels_threads.py, a TSan stress driver, and test_kernels_build.py, a
# torch-free syntax check) never load the module under test and are left out
KERNEL_TESTS=(tests/unit/test_kernels.py tests/unit/test_kernels_errors.py tests/unit/test_kernels_fast.py
              tests/integration/test_kernels_pack.py tests/gpu/test_kernels_cuda.py)
TEST_CMD=(env "LD_PRELOAD=${LIBASAN}" "ASAN_OPTIONS=detect_leaks=0:abort_on_error=1"
          "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1" "PYTHONPATH=${WORK}"
          "${PYTHON}" -m pytest -q -p no:cacheprovider "${WORK}/tests" "${PYTEST_ARGS[@]}")

if [[ ${DRY_RUN} -eq 1 ]]; then
  echo "copy h3t_ext csrc ${KERNEL_TESTS[*]} -> ${WORK}"
  echo "${BUILD_CMD[*]}"
  echo "${TORCH_BUILD_CMD[*]}"
  echo "(cd ${WORK} && ${TEST_CMD[*]})"
  exit 0
fi

rm -rf "${WORK}/h3t_ext" "${WORK}/csrc" "${WORK}/tests"
mkdir -p "${WORK}/tests/unit" "${WORK}/tests/integration" "${WORK}/tests/gpu"
cp -r "${REPO}/h3t_ext" "${REPO}/csrc" "${WORK}/"
find "${WORK}/h3t_ext" \( -name '*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
for t in "${KERNEL_TESTS[@]}"; do cp "${REPO}/${t}" "${WORK}/${t}"; done
"${BUILD_CMD[@]}"
"${TORCH_BUILD_CMD[@]}"
cd "${WORK}"
LOADED=$(env "LD_PRELOAD=${LIBASAN}" "ASAN_OPTIONS=detect_leaks=0" "PYTHONPATH=${WORK}" "${PYTHON}" -c \
  "import torch, h3t_ext.kernels._copy_cpu as m, h3t_ext.kernels._copy_torch as t; print(m.__file__); print(t.__file__)")
for so in ${LOADED}; do
  [[ "${so}" == "${WORK}"/* ]] || { echo "error: tests would load ${so}, not the ASan build" >&2; exit 1; }
  echo "ASan build: ${so}"
done
"${TEST_CMD[@]}"
