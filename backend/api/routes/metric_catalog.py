"""The metric catalogue (worker/tlt/metric_catalog.py): name, unit, kind and meaning of every metric a job writes.
The dashboard reads units (a `fraction` is drawn on a 0-1 axis) and kinds (a `cumulative` counter is never drawn as
a per-step value) from here instead of knowing them itself."""

from __future__ import annotations

from fastapi import APIRouter

from backend.api.deps import CurrentUser
from backend.schemas import MetricInfo
from worker.tlt.metric_catalog import CATALOG

router = APIRouter(tags=["telemetry"])


@router.get("/metrics/catalog", response_model=list[MetricInfo])
def metric_catalog(_user: CurrentUser) -> list[MetricInfo]:
    """Every metric name a job can write; `{field}` in a name stands for one path segment (`sd/arm/{arm}`)."""
    return [MetricInfo(name=m.name, unit=m.unit, kind=m.kind, meaning=m.meaning) for m in CATALOG]
