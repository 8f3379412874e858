"""Online vs frozen drafter while the policy trains: accept length, tail tokens/s, spot-training slowdown.

    python bench/drafter_online.py --out bench/results/drafter_online_h200.md \
        --json-out bench/results/drafter_online_h200.json                       # SmolLM2 + GSM8K, H200, ~5 min
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
4. Spot-training slowdown: a rollout sized like the GRPO main setting, so that it has a tail (--slowdown-prompts x
   --slowdown-samples, <= --slowdown-new-tokens, SD switch on below --slowdown-sd-on-below as in TLT), built by the
   product's `make_rollout` with its own drafter loaded from the trained one. With the engine's tail hook vs without,
   alternating, --slowdown-reps each after one dropped warm-up run; every run starts from the same drafter state
   (weights, buffer, generators), the same bandit state (the RL loop's) and the same seeds, so with and without
   decode the same responses (checked: `same_responses`; timing noise can still steer the bandit). Per run: wall
   time of the rollout and of its tail (the first switch-on step to the end), switch-on step seconds (the hook's
   credit: EngineConfig.tail_budget of them), hook seconds and drafter steps in the tail; with no step in the tail
   the figure reads INVALID. The cost of one drafter step is timed apart, to show whether the credit pays for one.
Prints and writes two markdown tables (--out; drafters per RL point, slowdown per pair) with notes, and everything
as JSON (--json-out). On the H200 runner:
`bench/h200.sh drafter_online` (writes drafter_online.md and drafter_online.json under $OUT).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from worker.tlt.build import build_trainer
from worker.tlt.config import JobSpec
from worker.tlt.rl.engine_adapter import make_rollout
from worker.tlt.rollout.adaptive_loop import TailBudget, TailHook
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.speculative_step import row_filters
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer, EagleProposerConfig
from worker.tlt.speculative.drafter.export import export_drafter
from worker.tlt.speculative.drafter.measure import run_arm
from worker.tlt.speculative.drafter.model import EagleDrafter
from worker.tlt.speculative.drafter.online import OnlineDrafter

log = logging.getLogger("drafter_online")
CHAIN, TREE = "chain k=6", "tree d=6 k=4 v=32"
QUICK = {"warmup_prompts": 4, "warmup_steps": 4, "new_tokens": 12, "prompts": 2, "samples": 2, "spot_steps": 2,
         "points": "0,2", "eval_batch": 2, "slowdown_reps": 1, "context": 16,
         "slowdown_prompts": 2, "slowdown_samples": 4, "slowdown_new_tokens": 24,  # 8 < 32 active: all tail
         "buffer_gb": 0.01}


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
        # TLT's threshold switch: the slowdown measures spot training in switch-on tail steps, which the default cost
        # switch would not give where SD does not pay (SmolLM2, CPU)
        "rollout": {"speculative": "adaptive", "sd_on_below": a.sd_on_below, "sd_switch": "active_batch",
                    "kv_cache_gb": 4.0 if not tiny else 0.05},
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
    # at most 512 sequences at once (continuous batching admits the rest): 4,096 prompts at once had a KV cache of
    # ~110 GB that the RL steps after the warm-up then ran out of memory beside
    eng = Engine(model, eos_ids=eos, config=EngineConfig(max_len=max_len, max_slots=min(len(prompts), 512),
                                                         seed=a.seed, capture_layers=od.capture_layers),
                 hidden_hook=od.hidden_hook)
    t0 = time.perf_counter()
    new = a.warmup_new_tokens or a.new_tokens
    out = eng.generate([Request(p, RequestSampling(temperature=a.temperature, max_new_tokens=new)) for p in prompts])
    eng.release_memory()  # its KV cache and graphs are not needed again
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    curve = []  # (steps so far, acc / loss over the chunk): does more training still pay?
    chunk = a.warmup_log_every or a.warmup_steps
    done = 0
    while done < a.warmup_steps:
        od.trainer.train(lambda: False, min(chunk, a.warmup_steps - done))
        done = min(done + chunk, a.warmup_steps)
        m = od.trainer.metrics()
        curve.append({"steps": done, "loss": m.get("drafter/loss", 0.0), "acc": m.get("drafter/acc", 0.0)})
    log.info("warm-up curve: %s", curve)
    return {"gen_s": t_gen, "tokens": out.tokens, "buffer_rows": len(od.buffer), "train_s": time.perf_counter() - t0,
            "steps": a.warmup_steps, "loss": curve[-1]["loss"], "acc": curve[-1]["acc"], "curve": curve}


def measure_point(model: Any, props: dict[tuple[str, str], EagleProposer], prompts: list[list[int]],
                  eos: tuple[int, ...], max_len: int, a: argparse.Namespace) -> dict[str, Any]:
    params = RequestSampling(temperature=a.temperature, max_new_tokens=a.new_tokens)
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


class MeteredTail(TailBudget):
    """The engine's TailBudget that also times the tail, hook or not: the switch-on step seconds it is shown (the
    base of the hook's credit) and when the first of them started."""

    def __init__(self, hook: TailHook | None, fraction: float, cap_s: float, clock: Callable[[], float]) -> None:
        super().__init__(hook, fraction, cap_s, clock)
        self.on_s = 0.0
        self.first_on: float | None = None

    def reset(self) -> None:
        super().reset()
        self.on_s, self.first_on = 0.0, None

    def earn_and_spend(self, step_seconds: float) -> None:
        if self.first_on is None:
            self.first_on = self.clock() - step_seconds
        self.on_s += step_seconds
        super().earn_and_spend(step_seconds)


def drafter_step_s(od: OnlineDrafter, reps: int = 5) -> float:
    """Median wall time of one spot-training step called as the tail hook calls it (one step, synchronized), but
    with the buffer's window index already built; nan when the buffer holds no training pair."""
    times = []
    with torch.enable_grad():
        for _ in range(reps):
            t0 = time.perf_counter()
            if od.trainer.train(lambda: False, 1, idle_s=0.0) == 0:
                return float("nan")
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def slowdown(trainer: Any, od: OnlineDrafter, a: argparse.Namespace) -> dict[str, Any]:
    """The TLT-sized rollout with the tail hook (spot training between tail steps) and without (module docstring)."""
    sized = argparse.Namespace(**{**vars(a), "prompts": a.slowdown_prompts, "samples": a.slowdown_samples,
                                  "new_tokens": a.slowdown_new_tokens, "sd_on_below": a.slowdown_sd_on_below})
    rollout = make_rollout(job_spec(sized), trainer.model, trainer.tokenizer, trainer.model.head_weight.device)
    engine, sod = rollout.engine, rollout.drafter
    assert sod is not None and engine.tail.hook is not None, "the adaptive engine with the online drafter"
    hook = engine.tail.hook
    engine.tail = tail = MeteredTail(hook, engine.tail.fraction, engine.tail.cap_s, engine.tail.clock)
    state = copy.deepcopy(od.state_dict())  # the trained drafter: weights, optimizer, buffer, generators
    ctl, learned = engine.controller, trainer.rollout.engine.controller
    assert ctl is not None
    bandit = copy.deepcopy((learned or ctl).state_dict())  # what the RL loop's bandit learned (arms, random stream)

    def restore() -> None:  # deep copies: loading may alias the snapshot's tensors, which training then mutates
        sod.load_state_dict(copy.deepcopy(state))
        sod.begin_rollout(trainer.step_count)  # the newest weights to the engine, a fresh tail-training cap
        ctl.load_state_dict(copy.deepcopy(bandit))  # the bandit learns within a run: each starts where RL left it

    reqs = [Request(list(p.ids), RequestSampling(temperature=a.temperature, max_new_tokens=a.slowdown_new_tokens,
                                                n=a.slowdown_samples))
            for p in trainer.sampler.rows[: a.slowdown_prompts]]
    runs: list[dict[str, Any]] = []
    first: list[list[int]] | None = None
    same = True
    order = ["with"] + ["without", "with"] * a.slowdown_reps  # the first run warms up (captures) and is dropped
    for i, mode in enumerate(order):
        restore()
        tail.hook = hook if mode == "with" else None
        engine.gen.manual_seed(a.seed + 1000)
        sod.proposer.gen.manual_seed(a.seed + 1001)
        steps0 = sod.trainer.steps
        out = engine.generate(reqs)
        end = tail.clock()
        tokens = [s.tokens for s in out.sequences]
        first = first if first is not None else tokens
        same = same and tokens == first
        if i == 0:
            continue
        runs.append({"mode": mode, "rollout_s": out.seconds, "on_s": tail.on_s, "credit_s": tail.fraction * tail.on_s,
                     "tail_s": end - tail.first_on if tail.first_on is not None else 0.0, "hook_s": tail.used_s,
                     "hook_calls": tail.calls, "drafter_steps": sod.trainer.steps - steps0})
    restore()
    step_s = drafter_step_s(sod)
    pairs = []
    for off, on in zip(runs[0::2], runs[1::2], strict=True):
        pairs.append({**{f"{k}_with": v for k, v in on.items() if k != "mode"},
                      "rollout_s_without": off["rollout_s"], "tail_s_without": off["tail_s"],
                      "slowdown": on["rollout_s"] / off["rollout_s"] - 1.0,
                      "tail_slowdown": on["tail_s"] / off["tail_s"] - 1.0 if off["tail_s"] > 0 else None})
    w, wo = [r for r in runs if r["mode"] == "with"], [r for r in runs if r["mode"] == "without"]

    def med(rs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    # in the hook a step also rebuilds the buffer's window index (every capture drops it): dearer than alone
    in_hook = [r["hook_s"] / r["drafter_steps"] for r in w if r["drafter_steps"] > 0]
    t_with, t_without, tail_with, tail_without = (med(w, "rollout_s"), med(wo, "rollout_s"), med(w, "tail_s"),
                                                  med(wo, "tail_s"))
    return {"rollout_s_without": t_without, "rollout_s_with": t_with, "slowdown": t_with / t_without - 1.0,
            "tail_s_without": tail_without, "tail_s_with": tail_with,
            "tail_slowdown": tail_with / tail_without - 1.0 if tail_without > 0 else None,
            "tail_hook_s": med(w, "hook_s"), "spot_steps_in_tail": med(w, "drafter_steps"),
            "valid": all(r["drafter_steps"] > 0 for r in w), "credit_s": med(w, "credit_s"), "on_s": med(w, "on_s"),
            "drafter_step_s": step_s, "hook_step_s": statistics.median(in_hook) if in_hook else float("nan"),
            "tail_budget": tail.fraction, "step_cap": a.spot_steps,
            "same_responses": same, "sequences": a.slowdown_prompts * a.slowdown_samples, "pairs": pairs,
            "runs": runs}


INVALID = "INVALID: 0 drafter steps ran in the tail"


def pct(x: float | None, steps: float) -> str:
    """A slowdown as a signed percentage, or INVALID when no drafter step ran (the hook was never exercised)."""
    if steps <= 0:
        return INVALID
    return "n/a (no tail)" if x is None else f"{100 * x:+.1f}%"


def slowdown_lines(slow: dict[str, Any], a: argparse.Namespace) -> list[str]:
    lines = [
        "| pair | rollout s without | rollout s with | rollout slowdown | tail s without | tail s with "
        "| tail slowdown | hook s | hook calls | drafter steps in tail | switch-on s | credit earned s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, p in enumerate(slow["pairs"], start=1):
        n = p["drafter_steps_with"]
        lines.append(
            f"| {i} | {p['rollout_s_without']:.3f} | {p['rollout_s_with']:.3f} | {pct(p['slowdown'], n)} "
            f"| {p['tail_s_without']:.3f} | {p['tail_s_with']:.3f} | {pct(p['tail_slowdown'], n)} "
            f"| {p['hook_s_with']:.3f} | {p['hook_calls_with']} | {n} | {p['on_s_with']:.3f} "
            f"| {p['credit_s_with']:.3f} |")
    n = slow["spot_steps_in_tail"] if slow["valid"] else 0
    credit, alone, hooked = slow["credit_s"], slow["drafter_step_s"], slow["hook_step_s"]
    step = alone if math.isnan(hooked) else hooked
    timed = not math.isnan(step) and step > 0
    lines += [
        "",
        f"Spot-training slowdown of the RL rollout ({slow['sequences']} sequences = {a.slowdown_prompts} prompts x "
        f"{a.slowdown_samples} samples, <= {a.slowdown_new_tokens} new tokens, SD switch on below "
        f"{a.slowdown_sd_on_below} active; median of {a.slowdown_reps} alternating pairs after a dropped warm-up): "
        f"{slow['rollout_s_without']:.3f} s without the tail hook, {slow['rollout_s_with']:.3f} s with it "
        f"({pct(slow['slowdown'], n)}); the tail alone (first switch-on step to the end) {slow['tail_s_without']:.3f}"
        f" s -> {slow['tail_s_with']:.3f} s ({pct(slow['tail_slowdown'], n)}); hook {slow['tail_hook_s']:.3f} s, "
        f"{slow['spot_steps_in_tail']:.0f} drafter steps in the tail per rollout (cap {slow['step_cap']}).",
        f"Hook credit: {100 * slow['tail_budget']:g}% of {slow['on_s']:.3f} s of switch-on steps = {credit:.3f} s "
        f"earned per rollout; one drafter step costs "
        + (f"{1000 * hooked:.1f} ms in the hook, " if not math.isnan(hooked) else "")
        + f"{1000 * alone:.1f} ms alone"
        + (f" -> the credit pays for {credit / step:.1f} steps." if timed else ".")
        + (" The credit never pays for one drafter step: any step that ran is an overrun, and the figure measures "
           "that overrun, not the budget." if timed and credit < step else "")
        + ("" if slow["same_responses"] else " WARNING: with and without decoded different responses; the runs "
           "are not comparable."),
    ]
    return lines


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
    curve = ", ".join(f"{c['steps']}: {c['acc']:.2f}" for c in warm.get("curve", []))
    lines += [
        "",
        f"Model {a.model} ({a.device}), T={a.temperature}, eval batch {a.eval_batch} held-out prompts x "
        f"<= {a.new_tokens} new tokens (accept length = tokens emitted per sequence per verify). Warm-up: "
        f"{warm['steps']} drafter steps on {a.warmup_prompts} responses ({warm['buffer_rows']} rows; acc "
        f"{warm['acc']:.2f}; acc after N steps: {curve}). Each RL step: {a.prompts} prompts x {a.samples} samples, "
        f"a GRPO update at lr "
        f"{a.policy_lr:g}, <= {a.spot_steps} online drafter steps. Policy drift = ||W - W0|| / ||W0||.",
        "",
        *slowdown_lines(slow, a),
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
    ap.add_argument("--warmup-new-tokens", type=int, default=0, help="warm-up responses' max length (0: --new-tokens)")
    ap.add_argument("--warmup-log-every", type=int, default=0, help="warm-up acc / loss every N steps (0: at the end)")
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
    ap.add_argument("--slowdown-prompts", type=int, default=8, help="slowdown rollout: prompts (GRPO main: 8)")
    ap.add_argument("--slowdown-samples", type=int, default=8, help="slowdown rollout: responses per prompt")
    ap.add_argument("--slowdown-new-tokens", type=int, default=1024, help="slowdown rollout: max new tokens")
    ap.add_argument("--slowdown-sd-on-below", type=int, default=32, help="slowdown rollout: SD switch (TLT: 32)")
    ap.add_argument("--slowdown-reps", type=int, default=3, help="alternating without/with pairs")
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
    max_len = max(len(p) for p in warm_p + eval_p) + max(a.new_tokens, a.warmup_new_tokens) + 8
    warm = warm_up(od, model, eos, warm_p, a, max_len)
    log.info("warm-up: %s", warm)
    if a.export_warm:  # a warm start for other runs (train_bench.py --drafter-warm-start), as the drafter job makes
        export_drafter(od.train_drafter, a.export_warm)

    cfg = od.train_drafter.cfg
    dt = model.head_weight.dtype  # served in the target's dtype, as OnlineDrafter's engine copy
    drafters = {"online": EagleDrafter(model, cfg).to(dev, dt), "frozen": EagleDrafter(model, cfg).to(dev, dt)}
    for d in drafters.values():
        d.load_state_dict(od.train_drafter.state_dict())
    props = {(role, arm): EagleProposer(d, EagleProposerConfig(context=a.context))
             for role, d in drafters.items() for arm in (CHAIN, TREE)}
    for (_, arm), p in props.items():
        if arm == CHAIN:
            p.capture(range(1, a.eval_batch + 1), depth=6, filters=row_filters([RequestSampling(temperature=a.temperature)]))
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
