#!/usr/bin/env bash
# Install the project into ./.venv exactly as CI does.
# torch goes first, pinned: with no torch installed, a requirement that admits a newer one pulls a CUDA build
# (several GB); with 2.13.0 present, nothing replaces it. Everything else is pinned by requirements/constraints.txt
# (the set tested together; see STACK-NOTES for why prefect/mlflow/fastapi/sqlalchemy are pinned).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet -c requirements/constraints.txt -e ".[dev,docs,workers]"
"$VENV/bin/python" -c "import torch, prefect, mlflow; print(f'installed: torch {torch.__version__}, prefect {prefect.__version__}, mlflow {mlflow.__version__}')"
