"""`tlt selfcheck --model tiny --json` -- the command as a user runs it, default prompts and samples (~30 s on 2
cores) -- runs the whole lossless check and passes (`passed` includes its negative control: a wrong acceptance
rule caught).
Run: python -m pytest tests/engine/test_engine_selfcheck_cli.py -q"""

from __future__ import annotations

import json

from worker.tlt.selfcheck import main


def test_selfcheck_tiny_passes(capsys) -> None:
    assert main(["--model", "tiny", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("sequences", "identical_sequences", "identical_token_fraction", "sampling_pvalue_min", "passed"):
        assert key in report
    assert report["passed"] and report["sequences"] == report["identical_sequences"] > 0
    assert report["identical_token_fraction"] == 1.0
