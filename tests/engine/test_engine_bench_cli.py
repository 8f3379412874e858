"""`tlt bench rollout|decode` runs end to end (tiny model, CPU smoke run) and prints the JSON fields the lead's
table needs. Run: python -m pytest tests/engine/test_engine_bench_cli.py -q"""

from __future__ import annotations

import json

from worker.tlt.bench import main


def test_bench_rollout_and_decode_json(capsys) -> None:
    args = ["--model", "tiny-llama", "--device", "cpu", "--max-new-tokens", "6", "--json"]
    assert main(["rollout", "--prompts", "2", "--samples", "3", "--sd", "on", *args]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["sequences"] == 6 and 6 <= res["tokens"] <= 36 and res["tokens_per_s"] > 0
    for key in ("seconds", "len_p50", "len_p90", "len_max", "capture_s"):
        assert key in res
    assert main(["decode", "--batch", "2", *args]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tokens"] == 12 and res["tokens_per_s"] > 0


def test_bench_rollout_adaptive_and_off_report_tail_and_buckets(capsys) -> None:
    args = ["rollout", "--model", "tiny-llama", "--device", "cpu", "--prompts", "3", "--samples", "2",
            "--max-new-tokens", "24", "--sd-on-below", "8", "--json"]  # 6 < 8: on after patience
    runs = {}
    for sd in ("off", "adaptive"):
        assert main([*args, "--sd", sd]) == 0
        runs[sd] = json.loads(capsys.readouterr().out)
    off, ada = runs["off"], runs["adaptive"]
    assert off["sd_metrics"]["sd/on_fraction"] == 0.0 and "perf/tokens_per_s_tail" in off["sd_metrics"]
    assert 0.0 < ada["sd_metrics"]["sd/on_fraction"] <= 1.0
    assert any(k.startswith("sd/arm/") for k in ada["sd_metrics"])
    for r in (off, ada):
        assert r["sequences"] == 6 and r["buckets"] and all(b["tokens_per_s"] > 0 for b in r["buckets"])
        assert sum(b["tokens"] for b in r["buckets"]) + 6 == r["tokens"]  # + the first token of each prefill
