"""The dashboard's API types are generated, not copied: frontend/src/api_schema.d.ts must equal what
`npm run gen:api` writes from the app's OpenAPI schema now (backend/openapi_schema.py, then openapi-typescript).
When this fails, run `cd frontend && npm run gen:api` and commit the result.

Run: python -m pytest tests/ui/test_api_types.py -q      (needs node and npm: scripts/setup.sh installs them)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FRONTEND = REPO / "frontend"
COMMITTED = FRONTEND / "src" / "api_schema.d.ts"


def test_generated_api_types_are_current(tmp_path: Path) -> None:
    npm = shutil.which("npm")
    assert npm, "npm is not installed (scripts/setup.sh installs it)"
    if not (FRONTEND / "node_modules" / ".bin" / "openapi-typescript").exists():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=FRONTEND, check=True)
    schema = subprocess.run([sys.executable, "-m", "backend.openapi_schema"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout
    (tmp_path / "openapi.json").write_text(schema)
    out = tmp_path / "api_schema.d.ts"
    subprocess.run([str(FRONTEND / "node_modules" / ".bin" / "openapi-typescript"), str(tmp_path / "openapi.json"),
                    "-o", str(out)], cwd=FRONTEND, capture_output=True, check=True)
    assert "/api/v1/metrics/catalog" in schema
    assert out.read_text() == COMMITTED.read_text(), (
        "frontend/src/api_schema.d.ts is stale: run `cd frontend && npm run gen:api` and commit it")
