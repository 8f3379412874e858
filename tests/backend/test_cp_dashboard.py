"""The built dashboard is served at / (client-side routes fall back to index.html) without shadowing the API."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from backend.core.config import Settings
from backend.main import create_app


def test_dashboard_static_and_fallback(cp_backend, tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    (dist / "assets").mkdir(parents=True)
    (dist / "index.html").write_text("<html>tlt</html>")
    (dist / "assets" / "app.js").write_text("console.log(1)")
    settings = Settings(**{**cp_backend.settings.model_dump(), "frontend_dir": dist})
    with TestClient(create_app(settings)) as client:
        assert client.get("/").text == "<html>tlt</html>"
        assert client.get("/assets/app.js").text == "console.log(1)"
        assert client.get("/jobs/12").text == "<html>tlt</html>"  # a client-side route
        assert client.get("/api/v1/jobs").status_code == 401  # the API still answers
        assert client.get("/api/v1/nope").status_code == 404
        assert client.get("/healthz").json() == {"status": "ok"}
