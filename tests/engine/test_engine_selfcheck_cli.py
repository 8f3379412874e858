"""`tlt selfcheck --model tiny --json` runs the whole lossless check and passes.
Run: python -m pytest tests/engine/test_engine_selfcheck_cli.py -q"""

from __future__ import annotations

import json

from worker.tlt.selfcheck import main


def test_selfcheck_tiny_passes(capsys) -> None:
    assert main(["--model", "tiny", "--json", "--prompts", "6", "--samples", "2000"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("sequences", "identical_sequences", "identical_token_fraction", "sampling_pvalue_min", "passed"):
        assert key in report
    assert report["passed"] and report["sequences"] == report["identical_sequences"] > 0
    assert report["identical_token_fraction"] == 1.0
