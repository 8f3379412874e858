"""Print the API's OpenAPI schema (JSON) without a database or broker: what the dashboard's types are generated
from (`npm run gen:api` in frontend/ writes src/api_schema.d.ts; tests/ui/test_api_types.py checks it is current).

    python -m backend.openapi_schema > openapi.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from backend.core.config import Settings
from backend.main import create_app


def schema() -> dict:
    """The schema of an app on throwaway settings (building the app connects to nothing)."""
    with tempfile.TemporaryDirectory() as home:
        return create_app(Settings(home=Path(home), check_schema=False)).openapi()


def main() -> int:
    sys.stdout.write(json.dumps(schema(), indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
