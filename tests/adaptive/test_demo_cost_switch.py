"""The demo's SD switch on CPU: the `demo-cpu` preset's rollout section (adaptive SD switched by measured step costs,
below 8 active sequences, its n-gram and EAGLE-1 arms) on a tiny random model measures plain and speculative steps
in the tail (its free probes: SD arms even where the bandit would pick plain decoding) and judges SD off where it
does not emit clearly more tokens per second than plain decoding, and reports the costs it
decided by (sd/step_s_plain/*, sd/step_s_sd/*, sd/gain/*, sd/pays/*), as the demo's dashboard shows them.

Run: python -m pytest tests/adaptive/test_demo_cost_switch.py -q      (seconds)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from worker.tlt.config import PRESETS, JobSpec
from worker.tlt.job_spec_file import merge_spec
from worker.tlt.job_spec_translate import request_sampling
from worker.tlt.model.load import load_model
from worker.tlt.rl.engine_adapter import make_rollout
from worker.tlt.rollout.reference import random_prompts
from worker.tlt.rollout.types import Request

ROLLOUTS = 6


def test_demo_switch_measures_sd_on_cpu_and_judges_it_off() -> None:
    spec = JobSpec.model_validate(merge_spec(PRESETS["demo-cpu"], {
        "model": {"builtin": "tiny-llama"}, "rollout": {"kv_cache_gb": 0.05}}))
    assert spec.rollout.sd_switch == "step_costs" and spec.rollout.speculative == "adaptive"
    model, tok = load_model(spec.model)
    engine = make_rollout(spec, model, tok, torch.device("cpu")).engine
    ctl = engine.controller
    assert ctl is not None and ctl.costs is not None and not ctl.captures  # CPU: every step is a measurement
    sampling = request_sampling(spec)
    # 8 responses of different lengths, as a GRPO step's: the batch shrinks below 8 and the tail is judged
    prompts = random_prompts(8, seed=1, lo=4, hi=9)
    summary: dict[str, float] = {}
    for k in range(ROLLOUTS):
        reqs = [Request(p, replace(sampling, max_new_tokens=8 + 6 * i, n=1)) for i, p in enumerate(prompts)]
        summary = engine.generate(reqs).sd_metrics
        if any(key.startswith("sd/pays/") for key in summary) and k >= 1:
            break
    pays = {key.removeprefix("sd/pays/"): v for key, v in summary.items() if key.startswith("sd/pays/")}
    assert pays, f"no batch size judged in {ROLLOUTS} rollouts: {summary}"
    off = [b for b, v in pays.items() if v == 0.0]
    assert off, f"SD judged to pay on CPU: {summary}"
    for b in off:  # judged from measured costs: both step costs reported, and SD's tokens/s per sequence lower
        assert summary[f"sd/step_s_plain/{b}"] > 0 and summary[f"sd/step_s_sd/{b}"] > 0
        assert f"sd/gain/{b}" in summary  # SD's tokens/s per sequence over plain's, as measured so far
    assert summary["sd/spec_step_fraction"] < 0.5  # SD stopped once judged: mostly plain decoding
