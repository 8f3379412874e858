#!/usr/bin/env bash
# The test command (README quick start, and what .ci/run calls): lint, type-check, then the whole CPU suite against
# this machine's Postgres and Redis. GPU tests (marker `gpu`) run only on a GPU machine: pytest -m gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
. .venv/bin/activate
ruff check backend worker tests bench
mypy backend worker
bash scripts/lanes.sh vllm hf-floor  # test lanes in .lanes/: vLLM's CPU build, transformers' floor (reused while pins match)
python -m pytest -q --durations=20 "$@"
