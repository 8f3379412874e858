"""Greedy generation with vLLM's CPU build, run by the vLLM lane's own interpreter (.lanes/vllm, scripts/lanes.sh):
the tests in this folder call it as a subprocess, so vLLM and its torch never enter the project's environment.

    .lanes/vllm/bin/python tests/vllm/vllm_greedy.py REQUEST.json   ->   one JSON line on stdout

REQUEST: {"policy": DIR, "prompts": [[ids...], ...], "max_tokens": N,
          "configs": {"plain": null, "eagle": {"method": "eagle", "model": DIR, "num_speculative_tokens": k}, ...}}
Each config gets its own `LLM` (in turn, in this one process: vLLM's import is the slow part). The answer maps each
config name to {"tokens": [[ids...], ...], "spec": {"drafts", "draft_tokens", "accepted_tokens"} | null}: the counts
vLLM reports in its spec-decoding metrics for that config's generation alone.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

# In-process engine on CPU: no engine-core subprocess, one worker in this process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; a few short prompts need little

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}


def _spec_counts(llm: Any) -> dict[str, int]:
    """The spec-decoding counters vLLM reports (summed over label sets; absent ones count 0)."""
    counts = dict.fromkeys(SPEC_COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            counts[SPEC_COUNTERS[metric.name]] += int(metric.value)
    return counts


def generate(policy: str, prompts: list[list[int]], max_tokens: int, spec: dict | None) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=policy, dtype="float32", distributed_executor_backend="uni", max_model_len=512,
              enforce_eager=True, seed=0, disable_log_stats=False, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = _spec_counts(llm)  # the counters live in a process-wide registry: count this generation's share
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    after = _spec_counts(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    gc.collect()
    return {"tokens": tokens, "spec": {k: after[k] - before[k] for k in after} if spec else None}


def main(request_path: str) -> int:
    req = json.loads(open(request_path).read())
    answer = {name: generate(req["policy"], req["prompts"], req["max_tokens"], spec)
              for name, spec in req["configs"].items()}
    print("VLLM_GREEDY " + json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
