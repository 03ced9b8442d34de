#!/usr/bin/env bash
# Create .venv (if missing) and install torchtune_dtf with the given extras, e.g.
#   bash scripts/setup_env.sh test
# torch is installed first and pinned exactly: on machines that provide a local CPU wheel of 2.13.0 pip
# takes it; a bare `torch` or a range would pull the registry's newest CUDA build (several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-eval,quickstart,experiments}
PY=${PYTHON:-python3}
echo "== using $($PY --version 2>&1) at $(command -v "$PY")"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --no-input)
"${PIP[@]}" install -q --upgrade pip setuptools wheel
FIND_LINKS=()
if [ -d /opt/wheels ]; then FIND_LINKS=(--find-links /opt/wheels); fi
"${PIP[@]}" install -q "${FIND_LINKS[@]}" "torch==2.13.0"
"${PIP[@]}" install -q "${FIND_LINKS[@]}" -e ".[$extras]"
if "${PIP[@]}" list 2>/dev/null | grep -i '^nvidia-'; then
    echo "warning: nvidia-* packages were installed (a CUDA torch build was pulled in)" >&2
fi
