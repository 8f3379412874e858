#!/usr/bin/env bash
# README command 1: set everything up, then start the service (API + worker + dashboard) on embedded defaults
# (SQLite database, SQLite broker, artifacts under .tlt/) and run the demo-cpu preset (GRPO with TLT's adaptive SD on
# SmolLM2-135M-Instruct, CPU). Prints each setup step, then the demo job's steps as they finish.
# Extra arguments go to `tlt up` (e.g. --port 8080, --exit to stop once the demo job ends).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/setup.sh
echo "quickstart [$((SECONDS - start))s] starting the API, one worker and the demo job"
exec .venv/bin/tlt up --demo "$@"
