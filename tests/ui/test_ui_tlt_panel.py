"""The job page's "TLT over training" panel in a real browser, on recorded metrics: a tiny TLT job (adaptive SD with
the n-gram and online EAGLE-1 drafters, CPU) runs to the end with a FileReporter, its metrics are loaded into a fresh
database through the worker's DbReporter, and frontend/e2e/tlt_panel.browser.mjs checks the panel: entropy, drafter
accuracy (0-1 axis) and accept length over the steps, and the time SD saved (the job's sd/saved_s_total) beside the
tail seconds of SD steps vs the plain estimate. The server and database come from test_ui_dashboard.py's fixtures.

Run: python -m pytest tests/ui/test_ui_tlt_panel.py -q      (needs node, npm and /usr/bin/chromium)
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from types import ModuleType

from backend.lifecycle import JobStatus
from backend.persistence import crud
from backend.persistence.db import make_engine, make_session_factory
from worker.db_reporter import DbReporter
from worker.tlt import metric_catalog as mc
from worker.tlt.file_reporter import FileReporter, read_metrics
from worker.tlt.train import run

HERE = Path(__file__).resolve().parent


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"ui_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_dash = _load(HERE / "test_ui_dashboard.py")
_seed = _load(HERE / "ui_seed.py")
_toy = _load(HERE.parent / "train" / "conftest.py")  # the toy-count job spec of the training tests
ui_env, api_url = _dash.ui_env, _dash.api_url  # the same server and database fixtures as the dashboard's test


def js_fmt(v: float) -> str:
    """The dashboard's fmt(v) (frontend/src/dom.ts) for the magnitudes these figures take (1e-3 <= |v| < 100)."""
    x = float(f"{v:.3g}")
    return str(int(x)) if x.is_integer() else repr(x)


def record_tlt_job(run_dir: Path) -> list[dict]:
    spec = _toy.make_toy_spec({"prompts_per_step": 2, "num_generations": 4, "max_completion_length": 12}, max_steps=5,
                    save_steps=100)
    spec = spec.model_copy(update={
        "rollout": spec.rollout.model_copy(update={"speculative": "adaptive", "sd_on_below": 64}),
        "drafter": spec.drafter.model_copy(update={"kind": "eagle1", "max_train_steps_per_rl_step": 2}),
    })
    run(spec, run_dir, FileReporter(run_dir))
    return [r["metrics"] for r in read_metrics(run_dir)]


def test_tlt_panel_in_chromium(ui_env: dict[str, str], api_url: str, tmp_path: Path) -> None:
    node, chromium = _dash._tool("node"), _dash._tool("chromium")
    _dash._build_frontend()
    steps = record_tlt_job(tmp_path / "run")
    saved = [m for m in steps if mc.SD_SAVED_S_TOTAL in m]
    accept = [m[mc.SD_ACCEPT_LEN] for m in steps if mc.SD_ACCEPT_LEN in m]
    assert saved and accept and any(mc.DRAFTER_ACC in m for m in steps), [sorted(m) for m in steps]

    engine = make_engine(ui_env["TLT_DATABASE_URL"])
    sessions = make_session_factory(engine)
    with sessions() as s:
        _, token = crud.create_token(s, "ui-admin", admin=True, name="tlt panel test")
    job_id = _seed.make_job(sessions, "ui-admin", "ui-tlt-run", JobStatus.running)
    rep = DbReporter(sessions, job_id, attempt=1, artifact_root=Path(ui_env["TLT_ARTIFACT_DIR"]))
    for step, m in enumerate(steps, start=1):
        rep.metrics(step, {k: v for k, v in m.items() if v is not None})
    rep.close()
    engine.dispose()

    entropy = [m["actor/entropy"] for m in steps]
    expect = {"steps": len(steps), "drafter_points": sum(mc.DRAFTER_ACC in m for m in steps),
              "saved": f"{js_fmt(saved[-1][mc.SD_SAVED_S_TOTAL])} s",
              "entropy": f"{js_fmt(entropy[0])} → {js_fmt(entropy[-1])}",
              "accept": f"{js_fmt(accept[0])} → {js_fmt(accept[-1])}"}
    env = {**ui_env, "UI_BASE_URL": api_url, "UI_TOKEN": token, "UI_JOB": str(job_id), "UI_EXPECT": json.dumps(expect),
           "CHROMIUM": chromium, "UI_SCREENSHOTS": str(_dash.SHOTS)}
    res = subprocess.run([node, "--test", "--test-reporter=spec", "e2e/tlt_panel.browser.mjs"], cwd=_dash.FRONTEND,
                         env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, f"browser test failed:\n{res.stdout[-6000:]}\n{res.stderr[-3000:]}"
    assert (_dash.SHOTS / "ui-tlt-panel.png").stat().st_size > 5_000
