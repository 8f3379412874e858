"""GRPO steps through the vLLM rollout backend (worker/tlt/rollout_vllm/), run by the vLLM lane's interpreter with this
checkout on PYTHONPATH (tests/vllm/test_vllm_rollout.py starts it): the trainer and vLLM share one process, as in a
job.

    .lanes/vllm/bin/python tests/vllm/vllm_rollout_check.py REQUEST.json   ->   one JSON line on stdout

REQUEST: {"spec": JobSpec dict (rollout.backend is set here), "prompts": [[ids...], ...], "new_tokens": N}
For each job: "tlt" (our engine, SD off), "vllm" (SD off), "vllm_sd" (SD on with the online EAGLE-3 drafter):
one RL step, its metrics and CPU seconds; for the vLLM jobs also greedy tokens of the prompts from vLLM before and
after the step's weight sync, the trainer's own greedy continuation after it, and for "vllm_sd" whether vLLM's
speculative model's parameters were all written by the drafter's reload after its training round.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from worker.tlt.build import build_trainer
from worker.tlt.config import JobSpec
from worker.tlt.data.prompts import RenderedPrompt
from worker.tlt.model.transformer import Transformer


class Quiet:
    """A Reporter that keeps nothing (the step's metrics are returned by trainer.step)."""

    def metrics(self, step: int, values: dict[str, float]) -> None: ...
    def histogram(self, step: int, name: str, edges: list[float], counts: list[int]) -> None: ...
    def log(self, line: str) -> None: ...
    def artifact(self, kind: Any, path: Path, step: int | None = None) -> None: ...
    def samples(self, step: int, rows: list[dict]) -> None: ...
    def should_stop(self) -> bool:
        return False


@torch.no_grad()
def trainer_greedy(model: Transformer, prompt: list[int], new_tokens: int, eos: tuple[int, ...]) -> list[int]:
    """The trainer's own forward, argmax token by token over the whole sequence (no cache: nothing shared with
    either engine), stopping after an EOS as the rollouts do."""
    ids, out = list(prompt), []
    for _ in range(new_tokens):
        nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
        out.append(nxt)
        ids.append(nxt)
        if nxt in eos:
            break
    return out


def run_job(name: str, data: dict[str, Any], prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    spec = JobSpec.model_validate(data)
    t0 = time.perf_counter()
    trainer, _ = build_trainer(spec, Quiet())
    build_s = time.perf_counter() - t0
    rollout, vllm = trainer.rollout, spec.rollout.backend == "vllm"
    rendered = [RenderedPrompt(ids=tuple(p), text="", example=trainer.sampler.rows[0].example) for p in prompts]
    answer: dict[str, Any] = {"build_s": build_s}
    if vllm:
        trajs, _ = rollout(rendered, 1, True)
        answer["vllm_greedy_before"] = [list(t.response) for t in trajs]
        eos = tuple(trainer.tokenizer.eos_ids)
        answer["trainer_greedy_before"] = [trainer_greedy(trainer.model, p, new_tokens, eos) for p in prompts]
    t0, c0 = time.perf_counter(), time.process_time()
    metrics, _, _ = trainer.step()
    answer["step_wall_s"], answer["step_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    answer["metrics"] = metrics
    if vllm:
        trajs, m = rollout(rendered, 1, True)
        answer["vllm_greedy_after"] = [list(t.response) for t in trajs]
        answer["greedy_sd_metrics"] = m
        answer["trainer_greedy_after"] = [trainer_greedy(trainer.model, p, new_tokens, eos) for p in prompts]
        if rollout.drafter is not None:
            answer["drafter_loaded_at"] = rollout.drafter.loaded_at
            answer["drafter_loaded"] = rollout.drafter.loaded
            answer["drafter_sent"] = sorted(rollout.drafter.serving_weights())
        answer["policy_loaded"] = rollout.loaded
        answer["vllm_params"] = rollout.engine.llm.collective_rpc(
            lambda w: sorted(n for n, _ in w.get_model().named_parameters()))[0]
        rollout.close()
    trainer.close()
    print(f"{name}: built in {build_s:.1f} s, step {answer['step_wall_s']:.1f} s wall, "
          f"{answer['step_cpu_s']:.1f} s CPU", file=sys.stderr, flush=True)
    return answer


def main(request_path: str) -> int:
    req = json.loads(Path(request_path).read_text())
    base, prompts, new_tokens = req["spec"], req["prompts"], req["new_tokens"]
    jobs = {
        "tlt": {**base, "rollout": {**base["rollout"], "backend": "tlt", "speculative": "off"},
                "drafter": {"kind": "none"}},
        "vllm": {**base, "rollout": {**base["rollout"], "backend": "vllm", "speculative": "off"},
                 "drafter": {"kind": "none"}},
        "vllm_sd": {**base, "rollout": {**base["rollout"], "backend": "vllm", "speculative": "on",
                                        "draft_depth": 3},
                    "drafter": {"kind": "eagle3", "max_train_steps_per_rl_step": 1}},
    }
    answer = {name: run_job(name, data, prompts, new_tokens) for name, data in jobs.items()
              if name in req.get("jobs", jobs)}
    print("VLLM_ROLLOUT " + json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
