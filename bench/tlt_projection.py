"""TLT's rollout speed-up as a cost model: a rollout's time from per-step costs by active batch size, the acceptance
by draft position and the response-length distribution; checked against measured rollouts, then used to project
real model shapes. One table:

    python bench/tlt_projection.py --run bench/results/tlt_run_h200.json --out bench/results/tlt_projection_h200.md

The model: every sequence of a rollout decodes its response; at each step the B sequences still running advance one
token (plain step, cost c_plain(B)) or, in the tail (B < --on-below) where SD pays (c_sd(B) / tau < c_plain(B), the
cost switch, judged on the tokens the step would emit: fewer than tau for sequences about to end), tau tokens on
average (SD step, cost c_sd(B)), tau = 1 + sum over positions k of the rate at which the
k-th draft token is accepted. Time = prefill + the sum of the step costs.
1. Validation: every paired rollout of a `bench/tlt_run.py` run (SD off twin and TLT twin), with that rollout's own
   lengths, its measured step costs per batch size (interpolated where a size was not seen) and acceptance; the
   table gives predicted vs measured seconds and the error. The costs come from the same rollouts, so this checks the
   composition (lengths -> active batch over time -> seconds, SD where the switch put it), not the costs themselves.
2. Projection: 1.5B / 7B / 8B shapes. c_plain(B) from bench/results/decode_shapes_h200.json (batch 1, 8, 64,
   interpolated in log B); c_sd(B) = c_plain(B) x the verify/step ratio measured there (8 tokens per row) + the fixed
   draft and bookkeeping time of a chain SD step measured on the widened 7B (spec_profile_widened_h200.json: SD step
   minus verify, depth 4), the same for every shape (smaller shapes' drafters are cheaper: conservative there).
   Acceptance 0.5-0.9 per position (conditional, tau = sum of a^k, k = 0..depth); lengths from the run's TLT-twin
   rollouts. Ratios are SD off / TLT rollout seconds (> 1 = TLT faster), a projection, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHAPES = ("shape:qwen2.5-1.5b", "shape:qwen2.5-7b", "shape:llama3-8b")
Cost = Callable[[int], float]  # active batch size -> seconds per step


def interpolate(points: dict[int, float]) -> Cost:
    """A cost for every batch size from measured (batch size -> seconds): linear in log B between measured sizes,
    flat below the smallest, proportional to B above the largest (a full batch is bandwidth-bound per row)."""
    xs = sorted(points)
    if not xs:
        raise ValueError("no measured step costs")

    def cost(b: int) -> float:
        if b <= xs[0]:
            return points[xs[0]]
        if b >= xs[-1]:
            return points[xs[-1]] * max(1.0, b / xs[-1]) if b > xs[-1] else points[xs[-1]]
        hi = next(x for x in xs if x >= b)
        lo = max(x for x in xs if x <= b)
        if hi == lo:
            return points[lo]
        w = (math.log(b) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return points[lo] + w * (points[hi] - points[lo])

    return cost


def rollout_seconds(lengths: list[int], plain: Cost, sd: Cost | None, tau: float, on_below: int,
                    prefill_s: float = 0.0, sd_at: Callable[[int], bool] | None = None) -> float:
    """Predicted rollout seconds: lengths are the responses' token counts (the first comes with the prefill)."""
    remaining = [float(n - 1) for n in lengths if n > 1]
    seconds = prefill_s
    while remaining:
        b = len(remaining)
        # tokens an SD step would really emit per sequence: a sequence about to end takes fewer than tau
        emitted = sum(min(tau, r) for r in remaining) / b
        use_sd = sd is not None and b < on_below and (sd_at(b) if sd_at else sd(b) / emitted < plain(b))
        step = tau if use_sd else 1.0
        seconds += sd(b) if use_sd and sd is not None else plain(b)
        remaining = [r - step for r in remaining if r - step >= 0.5]  # expected lengths: to the nearest token
    return seconds


def measured_costs(detail: dict[str, Any], kind: str) -> dict[int, float]:
    """Seconds per step by active batch size, of one kind of step ('decode' or 'spec'), from a paired rollout."""
    return {int(b): s / n for b, (n, s, _) in detail["steps"][kind].items() if n}


def validate(run: dict[str, Any], on_below: int) -> list[dict[str, Any]]:
    """Predicted vs measured seconds of every paired rollout's two twins (see the module docstring)."""
    rows = []
    for p in run["pairs"]:
        off, tlt = p["off_detail"], p["tlt_detail"]
        plain = interpolate({**measured_costs(off, "decode"), **measured_costs(tlt, "decode")})
        rows.append({"step": int(p["step"]), "twin": "SD off", "measured_s": p["off_s"],
                     "predicted_s": rollout_seconds(off["lengths"], plain, None, 1.0, on_below, off["prefill_s"])})
        spec = measured_costs(tlt, "spec")
        tau = 1.0 + sum(tlt["accept_rate_pos"])
        plain_t = measured_costs(tlt, "decode")
        # SD where the switch ran it: at sizes whose spec steps outnumber the plain ones
        chose_sd = {int(b) for b, c in tlt["steps"]["spec"].items() if c[0] > tlt["steps"]["decode"].get(b, [0])[0]}
        pred = rollout_seconds(tlt["lengths"], plain, interpolate(spec) if spec else None, tau, on_below,
                               tlt["prefill_s"], sd_at=chose_sd.__contains__)
        rows.append({"step": int(p["step"]), "twin": "TLT", "measured_s": p["tlt_s"], "predicted_s": pred,
                     "tau": tau, "plain_steps_seen": len(plain_t)})
    for r in rows:
        r["error"] = r["predicted_s"] / r["measured_s"] - 1.0 if r["measured_s"] else None
    return rows


def spec_step_share(run: dict[str, Any]) -> float:
    """Share of the TLT twins' decode steps that drafted and verified."""
    counts = [sum(c[0] for c in p["tlt_detail"]["steps"][k].values()) for p in run["pairs"] for k in ("spec", "decode")]
    return sum(counts[0::2]) / max(1, sum(counts))


def shape_costs(shapes: list[dict[str, Any]], spec_profile: dict[str, Any]) -> dict[str, tuple[Cost, Cost]]:
    """(c_plain, c_sd) per projected shape (see the module docstring)."""
    by_model = {s["model"]: s for s in shapes}
    ref = by_model["shape:qwen2.5-7b"]
    verify = statistics.fmean(v["verify_over_step"] for v in ref.get("verify", []) if "Triton" in v["forward"]) \
        if ref.get("verify") else 1.05
    arms = {a["arm"]: a["clean"]["wall_ms_per_step"] / 1e3 for a in spec_profile["arms"]}
    fixed = arms["chain SD"] - arms["SD off"] * verify  # draft + bookkeeping of one chain SD step
    out: dict[str, tuple[Cost, Cost]] = {}
    for name in SHAPES:
        rows = [r for r in by_model[name]["rows"] if "torch" not in r["forward"]]
        plain = interpolate({r["batch"]: r["step_ms"] / 1e3 for r in rows})
        out[name] = (plain, sd_cost(plain, verify, fixed))
    return out


def sd_cost(plain: Cost, verify: float, fixed: float) -> Cost:
    """c_sd(B) = c_plain(B) x verify/step + the fixed draft and bookkeeping seconds."""
    return lambda b: plain(b) * verify + fixed


def project(lengths_sets: list[list[int]], costs: dict[str, tuple[Cost, Cost]], depth: int, on_below: int,
            acceptances: list[float]) -> list[dict[str, Any]]:
    """SD off / TLT rollout-time ratio per shape and per-position acceptance, summed over the length sets."""
    rows = []
    for name, (plain, sd) in costs.items():
        off = sum(rollout_seconds(ls, plain, None, 1.0, on_below) for ls in lengths_sets)
        for a in acceptances:
            tau = sum(a ** k for k in range(depth + 1))
            tlt = sum(rollout_seconds(ls, plain, sd, tau, on_below) for ls in lengths_sets)
            rows.append({"shape": name, "acceptance": a, "tau": tau, "off_s": off, "tlt_s": tlt, "ratio": off / tlt})
    return rows


def render(res: dict[str, Any]) -> str:
    v = res["validation"]
    errs = [abs(r["error"]) for r in v if r["error"] is not None]
    within = sum(e <= 0.10 for e in errs)
    lines = [f"# TLT cost model: validation on measured rollouts, projection to real shapes ({res['device']})", "",
             f"Inputs: `{res['run']}` ({len(res['lengths_sets'])} paired rollouts, lengths {res['length_summary']}), "
             "decode_shapes_h200.json, spec_profile_widened_h200.json. See the docstring of bench/tlt_projection.py.",
             "", f"## Validation: predicted vs measured rollout seconds ({within} of {len(errs)} within 10%)", "",
             "| RL step | twin | measured s | predicted s | error |", "|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['twin']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | "
              f"{100 * r['error']:+.1f}% |" for r in v]
    lines += ["", f"- in-sample: each rollout's own step costs per batch size; the TLT twins drafted on "
              f"{100 * res['spec_step_share']:.1f}% of their decode steps, so the SD half of the model is checked only "
              "that far. Projection costs are the H200 tables; the lengths are the run's (device-independent)."]
    accs = sorted({r["acceptance"] for r in res["projection"]})
    lines += ["", f"## PROJECTION (not measured): SD off / TLT rollout time, chain depth {res['depth']}, SD below "
              f"{res['on_below']} active", "", "| shape | " + " | ".join(f"accept {a:.1f} (tau {sum(a ** k for k in range(res['depth'] + 1)):.2f})" for a in accs) + " |",
              "|---|" + "---|" * len(accs)]
    for shape in SHAPES:
        cells = [next(r for r in res["projection"] if r["shape"] == shape and r["acceptance"] == a) for a in accs]
        lines.append(f"| {shape} | " + " | ".join(f"{c['ratio']:.2f}x" for c in cells) + " |")
    lines += ["", "- acceptance = per-position conditional acceptance of the chain drafts; SD runs only in the tail and "
              "only where c_sd(B) / tau < c_plain(B) (the cost switch); rollout time only (the update and reward are "
              "not sped up by SD); a projection from measured step costs, not a measured speed-up.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default="bench/results/tlt_run_h200.json", help="bench/tlt_run.py's JSON")
    ap.add_argument("--shapes", default="bench/results/decode_shapes_h200.json")
    ap.add_argument("--spec-profile", default="bench/results/spec_profile_widened_h200.json")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--on-below", type=int, default=32)
    ap.add_argument("--acceptance", default="0.5,0.6,0.7,0.8,0.9")
    ap.add_argument("--out", default="bench/results/tlt_projection_h200.md")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    run = json.loads(Path(a.run).read_text())
    if not run.get("pairs"):
        raise SystemExit(f"{a.run} has no paired rollouts to validate against")
    lengths_sets = [p["tlt_detail"]["lengths"] for p in run["pairs"]]
    flat = sorted(n for ls in lengths_sets for n in ls)
    costs = shape_costs(json.loads(Path(a.shapes).read_text()), json.loads(Path(a.spec_profile).read_text()))
    res = {"run": a.run, "device": run.get("device", "?"), "depth": a.depth, "on_below": a.on_below,
           "lengths_sets": lengths_sets,
           "length_summary": f"mean {statistics.fmean(flat):.0f}, p50 {flat[len(flat) // 2]}, max {flat[-1]}",
           "validation": validate(run, a.on_below), "spec_step_share": spec_step_share(run),
           "projection": project(lengths_sets, costs, a.depth, a.on_below, [float(x) for x in a.acceptance.split(",")])}
    table = render(res)
    Path(a.out).write_text(table)
    (Path(a.json_out) if a.json_out else Path(a.out).with_suffix(".json")).write_text(json.dumps(res, indent=1))
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
