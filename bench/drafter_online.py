"""Online vs frozen drafter while the policy trains (issue 5): accept length, tail tokens/s, spot-training slowdown.

    python bench/drafter_online.py --out bench/results/drafter_online_h200.md \
        --json-out bench/results/drafter_online_h200.json                       # SmolLM2 + GSM8K, H200, ~4 min
    python bench/drafter_online.py --model tiny --quick --device cpu --out /tmp/o.md --json-out /tmp/o.json  # smoke

What runs (the product's own pieces, nothing re-implemented):
1. `worker.tlt.build.build_trainer` builds the policy, the GRPO trainer and the adaptive rollout engine with the
   online EAGLE-1 drafter (`rollout.speculative: adaptive`, `drafter.kind: eagle1`): the engine drafts with the
   drafter's published weights, captures hidden states, and spot-trains it in the tail (tail hook) and after the
   update (the trainer's drafter hook), up to --spot-steps drafter steps per RL step.
2. Warm-up: the policy generates --warmup-prompts GSM8K responses (T=1); the drafter trains --warmup-steps steps on
   their hidden states. A copy is frozen here.
3. The RL loop: `trainer.step()` = rollout -> rewards -> a real GRPO update of the policy (--policy-lr; fp32 master
   weights, so the target moves every step) -> drafter spot training on the newest rollouts. After 0, 5, 10, 20 RL
   steps (--points) both drafters are measured against the *current* policy on --eval-batch held-out prompts (the
   rollout's tail: batch <= 8), T=1: accept length (tokens emitted per verify, chain k=6 and the tree d=6 k=4 v=32)
   and decode tokens/s with SD vs SD off. The frozen drafter keeps its warm-up weights; it still reads the policy's
   live embedding and head (TLT's drafter shares them), so its drop is the trainable part going stale.
4. Spot-training slowdown: the same RL rollout (same prompts, seeds) with the engine's tail hook vs without,
   alternating, --slowdown-reps each after one warm-up run; the relative wall-time difference of the medians.
Prints and writes one markdown table (--out) with notes, and everything as JSON (--json-out). On the H200 runner:
`bench/h200.sh drafter_online` (writes drafter_online.md and drafter_online.json under $OUT).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from worker.tlt.build import build_trainer
from worker.tlt.config import JobSpec
from worker.tlt.drafter.export import export_drafter
from worker.tlt.drafter.measure import ARMS, run_arm
from worker.tlt.drafter.model import EagleDrafter
from worker.tlt.drafter.online import OnlineDrafter
from worker.tlt.drafter.proposer import EagleProposer, EagleProposerConfig
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, Request, SamplingParams

log = logging.getLogger("drafter_online")
CHAIN, TREE = "chain k=6", "tree d=6 k=4 v=32"
QUICK = {"warmup_prompts": 4, "warmup_steps": 4, "new_tokens": 12, "prompts": 2, "samples": 2, "spot_steps": 2,
         "points": "0,2", "eval_batch": 2, "slowdown_reps": 1, "context": 16}


class LogReporter:
    """build_trainer only logs through its reporter."""

    def log(self, line: str) -> None:
        log.info("%s", line)


def job_spec(a: argparse.Namespace) -> JobSpec:
    tiny = a.model == "tiny"
    return JobSpec.model_validate({
        "name": "drafter-online-bench",
        "model": {"builtin": "tiny-llama"} if tiny else {"builtin": a.model, "dtype": a.dtype},
        "dataset": ({"builtin": "toy-count", "system_prompt": None, "validation_size": 8, "max_prompt_length": 64}
                    if tiny else {"builtin": "gsm8k", "validation_size": 64, "max_prompt_length": 384}),
        "algorithm": {"num_generations": a.samples, "prompts_per_step": a.prompts, "max_completion_length": a.new_tokens,
                      "learning_rate": a.policy_lr, "temperature": a.temperature,
                      "reward_funcs": ["toy_count"] if tiny else ["math_accuracy"]},
        "rollout": {"speculative": "adaptive", "sd_on_below": a.sd_on_below, "kv_cache_gb": 4.0 if not tiny else 0.05},
        "drafter": {"kind": "eagle1", "max_train_steps_per_rl_step": a.spot_steps, "buffer_gb": a.buffer_gb,
                    "learning_rate": a.drafter_lr},
        "resources": {"gpus": 1 if a.device == "cuda" else 0},
        "max_steps": max(int(p) for p in a.points.split(",")) or 1,
        "save_steps": 1_000_000,
    })


def drift(model: torch.nn.Module, start: dict[str, torch.Tensor]) -> float:
    """||W - W0|| / ||W0|| over all policy weights: how far the GRPO updates moved the target."""
    num = den = 0.0
    for k, v in model.state_dict().items():
        num += float((v.float() - start[k].float()).pow(2).sum())
        den += float(start[k].float().pow(2).sum())
    return (num / max(den, 1e-30)) ** 0.5


def warm_up(od: OnlineDrafter, model: Any, eos: tuple[int, ...], prompts: list[list[int]], a: argparse.Namespace,
            max_len: int) -> dict[str, float]:
    od.begin_rollout(0)
    eng = Engine(model, eos_ids=eos, config=EngineConfig(max_len=max_len, max_slots=len(prompts), seed=a.seed,
                                                         capture_layers=od.capture_layers),
                 hidden_hook=od.hidden_hook)
    t0 = time.perf_counter()
    out = eng.generate([Request(p, SamplingParams(temperature=a.temperature, max_new_tokens=a.new_tokens))
                        for p in prompts])
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    od.trainer.train(lambda: False, a.warmup_steps)
    m = od.trainer.metrics()
    return {"gen_s": t_gen, "tokens": out.tokens, "buffer_rows": len(od.buffer), "train_s": time.perf_counter() - t0,
            "steps": a.warmup_steps, "loss": m.get("drafter/loss", 0.0), "acc": m.get("drafter/acc", 0.0)}


def measure_point(model: Any, props: dict[tuple[str, str], EagleProposer], prompts: list[list[int]],
                  eos: tuple[int, ...], max_len: int, a: argparse.Namespace) -> dict[str, Any]:
    params = SamplingParams(temperature=a.temperature, max_new_tokens=a.new_tokens)
    off = run_arm(model, None, prompts, params, "off", eos, max_len)
    row: dict[str, Any] = {"off_tokens_per_s": off["tokens_per_s"]}
    for (role, arm), prop in props.items():
        r = run_arm(model, None, prompts, params, arm, eos, max_len, proposer=prop, time_propose=False)
        key = f"{role}/{'chain' if arm == CHAIN else 'tree'}"
        row[f"{key}/accept_len"] = r["accept_len"]
        row[f"{key}/tokens_per_s"] = r["tokens_per_s"]
        row[f"{key}/speedup"] = r["tokens_per_s"] / max(off["tokens_per_s"], 1e-9)
        row[f"{key}/step_ms"] = r["step_ms"]
    return row


def slowdown(trainer: Any, od: OnlineDrafter, a: argparse.Namespace) -> dict[str, Any]:
    """The same RL rollout with the tail hook (spot training between tail steps) and without."""
    engine = trainer.rollout.engine
    hook = engine.tail.hook
    reqs = [Request(list(p.ids), SamplingParams(temperature=a.temperature, max_new_tokens=a.new_tokens, n=a.samples))
            for p in trainer.sampler.rows[: a.prompts]]
    runs: dict[str, list[float]] = {"with": [], "without": []}
    hook_s: list[float] = []
    spot = 0
    order = ["with"] + ["without", "with"] * a.slowdown_reps  # the first run warms up (captures) and is dropped
    for i, mode in enumerate(order):
        engine.tail.hook = hook if mode == "with" else None
        engine.gen.manual_seed(a.seed + 1000)
        od.begin_rollout(trainer.step_count)  # a fresh tail-training budget, the newest weights to the engine
        od.proposer.gen.manual_seed(a.seed + 1001)
        steps0 = od.trainer.steps
        out = engine.generate(reqs)
        if i == 0:
            continue
        runs[mode].append(out.seconds)
        if mode == "with":
            hook_s.append(out.sd_metrics.get("perf/tail_hook_s", 0.0))
            spot += od.trainer.steps - steps0
    engine.tail.hook = hook
    t_with, t_without = statistics.median(runs["with"]), statistics.median(runs["without"])
    return {"rollout_s_without": t_without, "rollout_s_with": t_with, "slowdown": t_with / t_without - 1.0,
            "tail_hook_s": statistics.median(hook_s), "spot_steps_in_tail": spot / max(len(runs["with"]), 1),
            "runs": runs}


def table(points: list[dict[str, Any]], slow: dict[str, Any], warm: dict[str, float], a: argparse.Namespace) -> str:
    lines = [
        "| RL steps | policy drift | accept chain online | accept chain frozen | accept tree online "
        "| accept tree frozen | SD off tok/s | chain online tok/s | tree online tok/s | chain frozen tok/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        lines.append(
            f"| {p['rl_steps']} | {p['policy_drift']:.2e} | {p['online/chain/accept_len']:.2f} "
            f"| {p['frozen/chain/accept_len']:.2f} | {p['online/tree/accept_len']:.2f} "
            f"| {p['frozen/tree/accept_len']:.2f} | {p['off_tokens_per_s']:.0f} "
            f"| {p['online/chain/tokens_per_s']:.0f} ({p['online/chain/speedup']:.2f}x) "
            f"| {p['online/tree/tokens_per_s']:.0f} ({p['online/tree/speedup']:.2f}x) "
            f"| {p['frozen/chain/tokens_per_s']:.0f} ({p['frozen/chain/speedup']:.2f}x) |")
    lines += [
        "",
        f"Model {a.model} ({a.device}), T={a.temperature}, eval batch {a.eval_batch} held-out prompts x "
        f"<= {a.new_tokens} new tokens (accept length = tokens emitted per sequence per verify). Warm-up: "
        f"{warm['steps']} drafter steps on {a.warmup_prompts} responses ({warm['buffer_rows']} rows; acc "
        f"{warm['acc']:.2f}). Each RL step: {a.prompts} prompts x {a.samples} samples, a GRPO update at lr "
        f"{a.policy_lr:g}, <= {a.spot_steps} online drafter steps. Policy drift = ||W - W0|| / ||W0||.",
        f"Spot-training slowdown of the RL rollout: {slow['rollout_s_without']:.2f} s without the tail hook, "
        f"{slow['rollout_s_with']:.2f} s with it ({100 * slow['slowdown']:+.1f}%; hook {slow['tail_hook_s']:.2f} s, "
        f"{slow['spot_steps_in_tail']:.0f} drafter steps in the tail per rollout; median of {a.slowdown_reps}).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a built-in model, or `tiny` (toy task)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="smoke-test sizes (seconds on CPU with --model tiny)")
    ap.add_argument("--warmup-prompts", type=int, default=128)
    ap.add_argument("--warmup-steps", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per RL step")
    ap.add_argument("--samples", type=int, default=4, help="responses per prompt")
    ap.add_argument("--spot-steps", type=int, default=16, help="online drafter steps per RL step")
    ap.add_argument("--points", default="0,5,10,20", help="RL steps after which both drafters are measured")
    ap.add_argument("--eval-batch", type=int, default=8, help="held-out prompts decoded at once (the tail)")
    ap.add_argument("--policy-lr", type=float, default=1e-5)
    ap.add_argument("--drafter-lr", type=float, default=3e-4)
    ap.add_argument("--buffer-gb", type=float, default=1.0)
    ap.add_argument("--sd-on-below", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--context", type=int, default=64, help="drafter context entries per propose")
    ap.add_argument("--slowdown-reps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--export-warm", default="", help="export the warmed-up drafter to this directory")
    ap.add_argument("--out", default="")
    ap.add_argument("--json-out", default="", help="default: --out with a .json suffix")
    a = ap.parse_args(argv)
    if a.out and not a.json_out:
        a.json_out = str(Path(a.out).with_suffix(".json"))
    if a.quick:
        for k, v in QUICK.items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if a.quick and a.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes: threads cost more than they give
    t_start = time.perf_counter()
    torch.manual_seed(a.seed)
    spec = job_spec(a)
    trainer, val = build_trainer(spec, LogReporter())  # type: ignore[arg-type]
    od = trainer.drafter
    assert isinstance(od, OnlineDrafter)
    model, eos = trainer.model, tuple(trainer.tokenizer.eos_ids)
    dev = model.head_weight.device
    warm_p = [list(p.ids) for p in trainer.sampler.rows[-a.warmup_prompts:]]
    eval_p = [list(p.ids) for p in val[: a.eval_batch]]
    max_len = max(len(p) for p in warm_p + eval_p) + a.new_tokens + 8
    warm = warm_up(od, model, eos, warm_p, a, max_len)
    log.info("warm-up: %s", warm)
    if a.export_warm:  # a warm start for other runs (train_bench.py --drafter-warm-start), as the drafter job makes
        export_drafter(od.train_drafter, a.export_warm)

    cfg = od.train_drafter.cfg
    dt = model.head_weight.dtype  # served in the target's dtype, as OnlineDrafter's engine copy
    drafters = {"online": EagleDrafter(model, cfg).to(dev, dt), "frozen": EagleDrafter(model, cfg).to(dev, dt)}
    for d in drafters.values():
        d.load_state_dict(od.train_drafter.state_dict())
    props = {(role, arm): EagleProposer(d, EagleProposerConfig(topk=ARMS[arm][1], context=a.context))
             for role, d in drafters.items() for arm in (CHAIN, TREE)}
    for (_, arm), p in props.items():
        if arm == CHAIN:
            p.capture_chain(range(1, a.eval_batch + 1), depth=6)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}

    points: list[dict[str, Any]] = []
    rl_rows: list[dict[str, float]] = []
    for target in sorted({int(p) for p in a.points.split(",")}):
        while trainer.step_count < target:
            m, _, _ = trainer.step()
            keep = ("reward/mean", "sd/accept_len", "sd/on_fraction", "drafter/loss", "drafter/acc", "drafter/steps",
                    "timing_s/gen", "timing_s/update", "timing_s/drafter", "timing_s/step", "perf/tokens_per_s_tail",
                    "harvest/idle_gpu_s", "harvest/used_gpu_s")
            rl_rows.append({"step": trainer.step_count, **{k: m[k] for k in keep if k in m}})
            log.info("RL step %d: %s", trainer.step_count, rl_rows[-1])
        drafters["online"].load_state_dict(od.train_drafter.state_dict())  # the newest online weights
        row = {"rl_steps": target, "policy_drift": drift(model, start), "drafter_steps": od.trainer.steps,
               **measure_point(model, props, eval_p, eos, max_len, a)}
        points.append(row)
        log.info("after %d RL steps: %s", target, row)
    slow = slowdown(trainer, od, a)
    md = table(points, slow, warm, a)
    print(md)
    if a.out:
        Path(a.out).write_text(md)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"settings": vars(a), "warmup": warm, "points": points,
                                                "rl_steps": rl_rows, "slowdown": slow,
                                                "wall_s": time.perf_counter() - t_start}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
