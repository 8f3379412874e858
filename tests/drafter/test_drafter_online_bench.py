"""bench/drafter_online.py runs end to end on CPU (tiny model, --quick): warm-up, GRPO steps that move the policy,
online vs frozen accept length at each point, tokens/s with SD vs off, the tail-hook slowdown; one table + JSON.

Run: python -m pytest tests/drafter/test_drafter_online_bench.py -q
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "drafter_online.py"


def test_quick_run_writes_the_table_and_json(tmp_path: Path) -> None:
    main = runpy.run_path(str(BENCH), run_name="drafter_online_bench")["main"]
    md, js = tmp_path / "o.md", tmp_path / "o.json"
    assert main(["--model", "tiny", "--quick", "--device", "cpu", "--out", str(md), "--json-out", str(js)]) == 0
    res = json.loads(js.read_text())
    points = res["points"]
    assert [p["rl_steps"] for p in points] == [0, 2]
    assert points[0]["policy_drift"] == 0.0 < points[1]["policy_drift"]  # the GRPO updates moved the target
    assert points[1]["drafter_steps"] > points[0]["drafter_steps"] == res["warmup"]["steps"]  # online training ran
    for p in points:
        for key in ("online/chain", "frozen/chain", "online/tree", "frozen/tree"):
            assert 1.0 <= p[f"{key}/accept_len"] <= 7.0 and p[f"{key}/tokens_per_s"] > 0
        assert p["off_tokens_per_s"] > 0
    assert [r["step"] for r in res["rl_steps"]] == [1, 2]
    slow = res["slowdown"]
    assert slow["rollout_s_with"] > 0 and slow["rollout_s_without"] > 0 and slow["spot_steps_in_tail"] >= 1
    assert slow["valid"] and slow["same_responses"]  # the hook ran; with and without decoded the same responses
    assert slow["sequences"] == 8 and len(slow["pairs"]) == 1 and [r["mode"] for r in slow["runs"]] == ["without", "with"]
    off, on = slow["runs"]
    assert off["hook_s"] == 0 == off["drafter_steps"] and on["drafter_steps"] >= 1 and on["hook_s"] > 0
    assert 0 < on["on_s"] < on["tail_s"] <= on["rollout_s"]  # the tail holds the switch-on steps and the hook
    assert on["credit_s"] == pytest.approx(slow["tail_budget"] * on["on_s"]) and slow["drafter_step_s"] > 0
    lines = md.read_text().splitlines()
    first = lines[: lines.index("")]
    assert first[0].startswith("| RL steps |") and len(first) == 2 + len(points)
    text = md.read_text()
    assert "| pair |" in text and "Spot-training slowdown" in text and "INVALID" not in text
    assert "drafter steps in the tail per rollout" in text and "Hook credit:" in text


def _slow(steps: int, credit_s: float, step_s: float) -> dict[str, Any]:
    pair = {"rollout_s_without": 10.0, "rollout_s_with": 10.1, "slowdown": 0.01, "tail_s_without": 4.0,
            "tail_s_with": 4.1, "tail_slowdown": 0.025, "hook_s_with": steps * step_s, "hook_calls_with": steps,
            "drafter_steps_with": steps, "on_s_with": credit_s / 0.03, "credit_s_with": credit_s}
    return {"pairs": [pair], "valid": steps > 0, "spot_steps_in_tail": float(steps), "credit_s": credit_s,
            "drafter_step_s": step_s, "hook_step_s": step_s if steps else float("nan"), "sequences": 64,
            "rollout_s_without": 10.0, "rollout_s_with": 10.1, "slowdown": 0.01, "tail_s_without": 4.0,
            "tail_s_with": 4.1, "tail_slowdown": 0.025, "tail_hook_s": steps * step_s, "step_cap": 16,
            "tail_budget": 0.03, "on_s": credit_s / 0.03, "same_responses": True}


def test_no_tail_step_reads_invalid_not_a_percentage() -> None:
    mod = runpy.run_path(str(BENCH), run_name="drafter_online_bench")
    a = mod["main"].__globals__["argparse"].Namespace(slowdown_prompts=8, slowdown_samples=8, slowdown_new_tokens=1024,
                                                      slowdown_sd_on_below=32, slowdown_reps=1)
    text = "\n".join(mod["slowdown_lines"](_slow(0, 0.12, 0.02), a))
    assert text.count("INVALID: 0 drafter steps ran in the tail") == 4  # the pair's two columns and the summary's
    assert "%" not in text.replace("3% of", "")
    assert "never pays" not in text  # 0.12 s of credit would pay for 6 steps of 20 ms
    ok = "\n".join(mod["slowdown_lines"](_slow(5, 0.12, 0.02), a))
    assert "INVALID" not in ok and "+1.0%" in ok and "+2.5%" in ok and "pays for 6.0 steps" in ok


def test_credit_below_one_step_is_said() -> None:
    mod = runpy.run_path(str(BENCH), run_name="drafter_online_bench")
    a = mod["main"].__globals__["argparse"].Namespace(slowdown_prompts=8, slowdown_samples=8, slowdown_new_tokens=1024,
                                                      slowdown_sd_on_below=32, slowdown_reps=1)
    text = "\n".join(mod["slowdown_lines"](_slow(1, 0.005, 0.02), a))
    assert "The credit never pays for one drafter step" in text and "0.005 s earned" in text and "20.0 ms" in text
