"""The metric catalogue (worker/tlt/metric_catalog.py): every metric name the library writes is in it, reporters
refuse names that are not, and the recorded run the UI tests are seeded from names only catalogue metrics.

Run: python -m pytest tests/ui/test_metric_catalog.py -q
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest
from sqlalchemy.orm import sessionmaker

from backend.persistence.db import make_engine
from worker.db_reporter import DbReporter
from worker.tlt.file_reporter import FileReporter, read_metrics
from worker.tlt.metric_catalog import CATALOG, check_names, lookup

REPO = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).with_name("recorded_run.json")
# The namespaces of metric names (worker/tlt/metric_catalog.py): a string literal under one of them is a metric name.
NAMESPACES = ("response_length", "reward", "actor", "rollout", "timing_s", "perf", "sd", "drafter", "harvest",
              "timeline", "val", "dist")
NAME_RE = re.compile(rf"^({'|'.join(NAMESPACES)})/[A-Za-z0-9_@.{{}}/-]*[A-Za-z0-9_@}}]$")
NOT_METRICS = re.compile(r"\.(py|json|safetensors|pt)$")  # file paths under the same words (speculative/drafter/online.py)


def _literal_names(path: Path) -> set[str]:
    """Metric-name-shaped string literals of one file; f-string fields become `{x}`."""
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if id(node) in parts:  # a piece of an f-string, seen whole below
            continue
        if isinstance(node, ast.JoinedStr):
            text = "".join(str(v.value) if isinstance(v, ast.Constant) else "{x}" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if NAME_RE.match(text) and not NOT_METRICS.search(text):
            out.add(text)
    return out


def test_every_metric_name_the_library_writes_is_in_the_catalogue() -> None:
    files = [p for p in (REPO / "worker").rglob("*.py") if p.name != "metric_catalog.py"]
    found = {(name, str(p.relative_to(REPO))) for p in files for name in _literal_names(p)}
    assert len({n for n, _ in found}) > 40  # the scan sees the library's names (a broken regex would pass vacuously)
    missing = sorted((n, f) for n, f in found if lookup(n.replace("{x}", "0")) is None)
    assert not missing, f"metric names written by the library but not in the catalogue: {missing}"


def test_catalogue_entries_are_unique_and_well_formed() -> None:
    names = [m.name for m in CATALOG]
    assert len(names) == len(set(names))
    for m in CATALOG:
        assert m.unit and m.meaning.endswith(".") and m.kind in ("per-step", "cumulative", "histogram"), m
        assert lookup(m.name.replace("{", "").replace("}", "")) is not None or "{" not in m.name
    assert lookup("sd/arm/eagle-c3").name == "sd/arm/{arm}"  # type: ignore[union-attr]
    assert lookup("timeline/gpu1/idle_s").name == "timeline/gpu{rank}/idle_s"  # type: ignore[union-attr]
    assert lookup("sd/arm/a/b") is None  # a template field is one path segment
    assert lookup("harvest/ratio").unit == "fraction"  # type: ignore[union-attr]
    assert lookup("harvest/idle_gpu_s_total").kind == "cumulative"  # type: ignore[union-attr]
    assert lookup("harvest/idle_gpu_s").kind == "per-step"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="sd/tail_tokens_per_s"):
        check_names(["reward/mean", "sd/tail_tokens_per_s"])


def test_file_reporter_refuses_unknown_names_and_writes_nothing(tmp_path: Path) -> None:
    rep = FileReporter(tmp_path)
    rep.metrics(1, {"reward/mean": 0.5, "sd/arm/none": 3.0})
    with pytest.raises(ValueError, match="made/up"):
        rep.metrics(2, {"reward/mean": 0.5, "made/up": 1.0})
    with pytest.raises(ValueError, match="lengths"):
        rep.histogram(2, "lengths", [0.0, 1.0], [1])
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    assert not (tmp_path / "histograms.jsonl").exists()


def test_db_reporter_refuses_unknown_names_before_touching_the_database(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'empty.db'}")  # no tables: any write would fail
    rep = DbReporter(sessionmaker(engine), job_id=1, attempt=1, artifact_root=tmp_path)
    with pytest.raises(ValueError, match="sd/tail_tokens_per_s_no_sd"):
        rep.metrics(1, {"sd/tail_tokens_per_s_no_sd": 40.0})
    with pytest.raises(ValueError, match="lengths"):
        rep.histogram(1, "lengths", [0.0, 1.0], [1])
    rep.close()  # nothing pending
    engine.dispose()


def test_the_ui_seed_names_only_catalogue_metrics() -> None:
    """The browser tests' seed replays the recorded run: every name it writes is the worker's own."""
    spec = importlib.util.spec_from_file_location("ui_seed", Path(__file__).with_name("ui_seed.py"))
    assert spec and spec.loader
    seed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seed)
    names = seed.seed_names()
    assert {"reward/mean", "perf/tokens_per_s_tail", "sd/spec_step_fraction", "harvest/ratio", "response_length",
            "perf/seq_tokens_per_s_tail_sd", "perf/seq_tokens_per_s_tail_plain", "sd/arm/none"} <= names
    check_names(names)
    run = json.loads(RECORDED.read_text())
    for step in run["steps"]:
        m = step["metrics"]
        assert 0 <= m["harvest/ratio"] <= 1
        assert m["harvest/used_gpu_s"] <= m["harvest/idle_gpu_s"] + 1e-9
