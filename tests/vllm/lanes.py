"""The test lanes (scripts/lanes.sh) as the tests use them: build a lane when it is missing or stale (the script does
nothing when its stamp matches), and run a helper script under it, reading back the one JSON line it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LANES = REPO / ".lanes"
HERE = Path(__file__).resolve().parent


def ensure_lane(name: str) -> Path:
    """Build (or confirm) .lanes/<name>; the floor lane is installed with this interpreter's pip."""
    env = {**os.environ, "PROJECT_PYTHON": sys.executable}
    done = subprocess.run(["bash", str(REPO / "scripts/lanes.sh"), name], cwd=REPO, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, f"scripts/lanes.sh {name} failed:\n{done.stdout}\n{done.stderr}"
    return LANES / name


def run_helper(python: str | Path, script: str, request: dict[str, Any], tmp: Path, marker: str,
               extra_env: dict[str, str] | None = None, timeout: float = 1200) -> dict[str, Any]:
    """Run tests/vllm/<script> REQUEST.json with `python`; returns the JSON after `marker` on its stdout."""
    req = tmp / f"{Path(script).stem}-request.json"
    req.write_text(json.dumps(request))
    env = {**os.environ, **(extra_env or {})}
    done = subprocess.run([str(python), str(HERE / script), str(req)], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(marker + " ")]
    assert done.returncode == 0 and lines, f"{script} failed ({done.returncode}):\n{done.stdout[-4000:]}\n" \
                                           f"{done.stderr[-8000:]}"
    return json.loads(lines[-1][len(marker) + 1:])
