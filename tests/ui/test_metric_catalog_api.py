"""GET /api/v1/metrics/catalog: the catalogue the dashboard reads units and kinds from (token required).

Run: python -m pytest tests/ui/test_metric_catalog_api.py -q
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from backend.core import migrate
from backend.core.config import Settings
from backend.main import create_app
from backend.persistence import crud
from backend.persistence.db import make_engine, make_session_factory
from worker.tlt.metric_catalog import CATALOG


@pytest.fixture
def client_and_token(tmp_path: Path) -> Iterator[tuple[TestClient, str]]:
    url = f"sqlite:///{tmp_path / 'api.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    with make_session_factory(engine)() as s:
        _, token = crud.create_token(s, "alice", admin=False, name="catalog test")
    engine.dispose()
    settings = Settings(home=tmp_path / "home", database_url=url, broker_url=f"sqla+sqlite:///{tmp_path / 'b.db'}")
    with TestClient(create_app(settings)) as client:
        yield client, token


def test_catalog_is_served_whole_to_a_token(client_and_token: tuple[TestClient, str]) -> None:
    client, token = client_and_token
    assert client.get("/api/v1/metrics/catalog").status_code == 401
    res = client.get("/api/v1/metrics/catalog", headers={"Authorization": f"Bearer {token}"})
    assert res.status_code == 200
    rows = {r["name"]: r for r in res.json()}
    assert len(rows) == len(CATALOG)
    assert rows["harvest/ratio"] == {"name": "harvest/ratio", "unit": "fraction", "kind": "per-step",
                                     "meaning": next(m.meaning for m in CATALOG if m.name == "harvest/ratio")}
    assert rows["harvest/used_gpu_s_total"]["kind"] == "cumulative"
    assert rows["response_length"]["kind"] == "histogram" and "sd/arm/{arm}" in rows
    doc = client.get("/openapi.json").json()
    assert "MetricInfo" in doc["components"]["schemas"]
    assert "/api/v1/metrics/catalog" in doc["paths"]
