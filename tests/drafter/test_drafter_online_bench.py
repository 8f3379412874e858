"""bench/drafter_online.py runs end to end on CPU (tiny model, --quick): warm-up, GRPO steps that move the policy,
online vs frozen accept length at each point, tokens/s with SD vs off, the tail-hook slowdown; one table + JSON.

Run: python -m pytest tests/drafter/test_drafter_online_bench.py -q
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

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
    table = md.read_text().splitlines()
    assert table[0].startswith("| RL steps |") and len([x for x in table if x.startswith("|")]) == 2 + len(points)
    assert "Spot-training slowdown" in md.read_text()
