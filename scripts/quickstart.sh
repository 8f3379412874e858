#!/usr/bin/env bash
# README command 1: set everything up, then start the service (API + worker + dashboard) on embedded defaults
# (SQLite database, SQLite broker, artifacts under .tlt/) and run the demo GRPO job with TLT on SmolLM2, on CPU.
# Extra arguments go to `tlt up` (e.g. --port 8080, --exit to stop once the demo job ends).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tlt up --demo "$@"
