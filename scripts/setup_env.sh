#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and install h3t-ext into it.
# Idempotent: a second run only checks that everything is there.
#   PYTHON=python3.11 bash scripts/setup_env.sh
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
VENV=${VENV:-$ROOT/.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -r "$ROOT/requirements.txt"
# No build isolation: the native kernels need only pybind11 (installed above), and an isolated
# build environment could pull a CUDA torch.
"${PIP[@]}" install --no-build-isolation --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import h3t_ext, torch; print('h3t-ext environment ready: torch', torch.__version__)"
