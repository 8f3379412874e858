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
