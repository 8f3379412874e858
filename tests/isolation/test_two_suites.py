"""Two test runs on one machine do not break each other, and a killed run's leftovers cannot stall the next: two pytest
sessions of probe_isolation.py run at once, with a stale build lock planted in the user-wide torch extensions cache
(as a killed DeepSpeed op build leaves it). Each must pass within its per-test timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_suites_at_once_with_a_stale_extension_lock(tmp_path: Path) -> None:
    cache = tmp_path / "xdg-cache"
    for build_root in (cache / "torch_extensions", cache / "torch_extensions" / "py311_cpu"):
        (build_root / "tlt_probe").mkdir(parents=True)
        (build_root / "tlt_probe" / "lock").touch()  # what a killed build leaves: torch waits on it forever
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "TLT_TEST_EXTENSIONS_OWNED")}
    env.update(XDG_CACHE_HOME=str(cache), TLT_PROBE_BARRIER=str(barrier))
    runs = [subprocess.Popen(
        [sys.executable, "-m", "pytest", "tests/isolation/probe_isolation.py", "-q", "-p", "no:cacheprovider",
         "--timeout", "240"],
        cwd=REPO, env={**env, "TLT_PROBE_NAME": name}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name in ("a", "b")]
    outputs = [run.communicate(timeout=600)[0] for run in runs]
    for run, out in zip(runs, outputs, strict=True):
        assert run.returncode == 0, out
        assert "2 passed" in out, out
    assert (cache / "torch_extensions" / "tlt_probe" / "lock").exists()  # the stale lock was never waited on
