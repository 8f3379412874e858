"""`tlt up [--demo]`: migrate, start the API and one Celery worker on embedded defaults, optionally run the demo job
and print its closing summary."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from worker.cli.admin import create_token
from worker.cli.output import EXIT_API, exit_code_for, out

log = logging.getLogger("tlt")


def _spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    log.info("starting %s", " ".join(cmd))
    return subprocess.Popen(cmd, env=env)


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 15.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("the API or the worker exited during start-up (see its output above)")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the API did not answer on {url}/healthz within {timeout_s:.0f} s")


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    """Migrate, start uvicorn + one Celery worker (threads pool, 1 slot, queues cpu and gpu), optionally run the demo."""
    from backend.core.config import get_settings
    from backend.core.migrate import upgrade
    from worker import registry

    with socket.socket() as sock:  # fail early and clearly instead of talking to whatever holds the port
        if sock.connect_ex((args.host, args.port)) == 0:
            sys.stderr.write(f"tlt: {args.host}:{args.port} is already in use; pick another with --port\n")
            return EXIT_API
    settings = get_settings()
    settings.ensure_dirs()
    upgrade(settings.database_url)
    env = dict(os.environ, TLT_HOME=str(settings.home), TLT_DATABASE_URL=settings.database_url,
               TLT_BROKER_URL=settings.broker_url, TLT_ARTIFACT_DIR=str(settings.artifacts))
    url = f"http://{args.host}:{args.port}"
    py = sys.executable
    signal.signal(signal.SIGTERM, _raise_interrupt)
    procs = [
        _spawn([py, "-m", "uvicorn", "backend.main:create_app", "--factory", "--host", args.host,
                "--port", str(args.port), "--log-level", "warning"], env),
        _spawn([py, "-m", "celery", "-A", "worker.celery_app", "worker", "-Q", "cpu,gpu", "--pool", "threads",
                "--concurrency", "1", "-n", "tlt@%h", "--loglevel", "INFO"], env),
    ]
    try:
        _wait_healthy(url, procs)
        registry.wait_for_worker(settings.database_url, settings.worker_ttl_s,
                                 alive=lambda: all(p.poll() is None for p in procs))
        out(f"TLT Studio is up: {url}  (API docs {url}/docs; database {settings.database_url})")
        rc = 0
        if args.demo:
            rc = _run_demo(url, settings.artifacts, procs, args.demo_spec)
            if args.exit:
                return rc
        out("Ctrl-C stops the API and the worker.")
        while all(p.poll() is None for p in procs):
            time.sleep(1.0)
        out("the API or the worker exited; stopping")
        return EXIT_API
    except KeyboardInterrupt:
        out("stopping")
        return 0
    finally:
        _stop(procs)


def _run_demo(url: str, artifacts: Path, procs: list[subprocess.Popen[bytes]], spec_file: str | None) -> int:
    import yaml

    from worker.client import FINAL_STATUSES, TltClient
    from worker.tlt.config import preset

    spec = yaml.safe_load(Path(spec_file).read_text()) if spec_file else preset("demo-cpu").model_dump(mode="json")
    token = create_token("admin", admin=True, name="demo", promote=True)  # the operator's own demo: an admin token
    client = TltClient(url, token)
    job = client.submit(spec)
    out(f"dashboard:  {url}/#/jobs/{job['id']}  (sign in with this token)\ntoken:      {token}\n"
         f"artifacts:  {artifacts / 'jobs' / str(job['id'])}\n"
         f"job {job['id']} ({job['name']}) submitted; waiting for it (tlt logs -f {job['id']} --token ...)")
    status, seen_log, t0 = job["status"], 0, time.monotonic()
    while status not in FINAL_STATUSES:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("the API or the worker exited while the demo job ran")
        time.sleep(2.0)
        for line in client.logs(job["id"], after_id=seen_log):  # the training loop's own progress lines
            seen_log = max(seen_log, line["id"])
            if line["stream"] == "log":
                out(f"job {job['id']} [{time.monotonic() - t0:.0f}s]: {line['line']}")
        new = client.job(job["id"])["status"]
        if new != status:
            out(f"job {job['id']} [{time.monotonic() - t0:.0f}s]: {new}")
        status = new
    final = client.job(job["id"])
    out(f"demo job {final['id']} {final['status']} in {time.monotonic() - t0:.0f} s"
         + (f": {final['reason']}" if final.get("reason") else ""))
    history = client.metrics(job["id"])
    for text in demo_summary(history) + switch_summary(history):
        out(text)
    for art in client.artifacts(job["id"]):
        out(f"  {art['kind']:<11} step {art['step']}  {art['size']:>12} bytes  sha256 {art['sha256'][:16]}...")
    return exit_code_for(final["status"])


DEMO_SUMMARY = {  # metric -> what the demo's closing lines call it
    "reward/mean": "reward (mean of the step's responses)",
    "sd/on_fraction": "SD on (share of decode steps)",
    "sd/accept_len": "SD accept length (tokens per verify)",
    "drafter/acc": "EAGLE drafter top-1 accuracy",
}


def demo_summary(history: dict[str, Any]) -> list[str]:
    """One line per DEMO_SUMMARY metric the job reported: its first and last step's values and its highest (a step
    of 8 responses can dip: the last alone would hide where the run went)."""
    out = []
    for series in history.get("series", []):
        pts = [p for p in series["points"] if p["value"] is not None]
        if series["name"] in DEMO_SUMMARY and pts:
            first, last = pts[0], pts[-1]
            top = max(pts, key=lambda p: p["value"])
            out.append(f"  {DEMO_SUMMARY[series['name']]:<40} step {first['step']}: {first['value']:.3f}  ->  "
                       f"step {last['step']}: {last['value']:.3f}  (highest {top['value']:.3f} at step {top['step']})")
    return out


def switch_summary(history: dict[str, Any]) -> list[str]:
    """The SD switch's verdict per batch size when it went by measured step costs (sd/pays/<bucket>, with the costs
    it read at the last step: sd/step_s_plain, sd/step_s_sd, sd/gain), one line each; nothing for a threshold switch."""
    last = {s["name"]: next((p["value"] for p in reversed(s["points"]) if p["value"] is not None), None)
            for s in history.get("series", [])}
    lines = []
    for name, pays in sorted(last.items()):
        if not name.startswith("sd/pays/") or pays is None:
            continue
        b = name.removeprefix("sd/pays/")
        plain, sd, gain = last.get(f"sd/step_s_plain/{b}"), last.get(f"sd/step_s_sd/{b}"), last.get(f"sd/gain/{b}")
        costs = f"plain step {plain * 1e3:.0f} ms, SD step {sd * 1e3:.0f} ms" if plain and sd else "costs not kept"
        gain_text = f"{gain:.2f}x" if gain is not None else "?"
        lines.append(f"  SD switch at {b} active: {'on' if pays > 0.5 else 'off'} (measured: {costs}; SD gives "
                     f"{gain_text} plain decoding's tokens/s per sequence)")
    return lines
