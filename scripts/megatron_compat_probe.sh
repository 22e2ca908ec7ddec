#!/usr/bin/env bash
# Runs h3t-ext's CPU tests against a newer megatron-core wheel (0.17-0.19, built for Python 3.12) on this Python 3.11
# machine, as a compatibility probe: users train on 0.16 to 0.19, CI has only 0.16.1.
#
# The wheel's pure-Python modules run on 3.11 with three stand-ins, none of them in the package or the tests:
#   * triton (megatron-core imports it at module level) from PyPI, into a scratch folder;
#   * typing.override (3.12; megatron.training imports it) from typing_extensions, by a sitecustomize.py;
#   * the dataset helpers' compiled module (helpers_cpp, cp312 in the wheel) from the installed megatron-core's
#     cp311 build (the same C++ API in 0.16-0.19).
# A failure here is a megatron-core API the code has to follow (or a stand-in's limit: read the traceback).
#
#   WHEEL=path/to/megatron_core-0.19.2-*.whl [PYTHON=.venv/bin/python] [WORK=/tmp/h3t-mcore-probe] \
#     bash scripts/megatron_compat_probe.sh [--dry-run] [pytest args...]     # default: tests/unit
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-${REPO}/.venv/bin/python}
WORK=${WORK:-/tmp/h3t-mcore-probe}
WHEEL=${WHEEL:-}
DRY_RUN=0
PYTEST_ARGS=()
for arg in "$@"; do
  if [[ "${arg}" == "--dry-run" ]]; then DRY_RUN=1; else PYTEST_ARGS+=("${arg}"); fi
done
[[ ${#PYTEST_ARGS[@]} -gt 0 ]] || PYTEST_ARGS=(tests/unit)
SITE=${WORK}/site
PATHS="${WORK}/shim:${SITE}:${WORK}/triton"
TEST_CMD=(env "PYTHONPATH=${PATHS}" "${PYTHON}" -m pytest -q -p no:cacheprovider "${PYTEST_ARGS[@]}")
if [[ ${DRY_RUN} == 1 ]]; then
  echo "WHEEL=${WHEEL:-<unset>} WORK=${WORK} PYTHON=${PYTHON}"
  printf '%q ' "${TEST_CMD[@]}"; echo
  exit 0
fi
[[ -n ${WHEEL} && -f ${WHEEL} ]] || { echo "megatron_compat_probe.sh: error: WHEEL=${WHEEL:-} is not a megatron-core wheel file" >&2; exit 2; }
WHEEL=$(cd "$(dirname "${WHEEL}")" && pwd)/$(basename "${WHEEL}")

mkdir -p "${WORK}/shim"
rm -rf "${SITE}" && mkdir -p "${SITE}"
(cd "${SITE}" && "${PYTHON}" -m zipfile -e "${WHEEL}" .)
[[ -d ${WORK}/triton/triton ]] || "${PYTHON}" -m pip install -q --no-deps --target "${WORK}/triton" triton
cat >"${WORK}/shim/sitecustomize.py" <<'EOF'
import typing

import typing_extensions

if not hasattr(typing, "override"):  # Python 3.12's, which megatron.training imports
    typing.override = typing_extensions.override
EOF
HELPERS=$("${PYTHON}" -c "import glob, os, megatron.core.datasets as d; print(glob.glob(os.path.join(os.path.dirname(d.__file__), 'helpers_cpp*.so'))[0])")
cp "${HELPERS}" "${SITE}/megatron/core/datasets/"
VERSION=$(PYTHONPATH=${PATHS} "${PYTHON}" -c "from importlib.metadata import version; print(version('megatron-core'))" 2>/dev/null || echo "?")
echo "megatron-core ${VERSION} from ${WHEEL} on $("${PYTHON}" -V)"
cd "${REPO}"
exec "${TEST_CMD[@]}"
