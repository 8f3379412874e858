"""`tlt`: the one command of TLT Studio.

    tlt up [--demo] [--port 8000]        API + one Celery worker on embedded defaults (SQLite + SQLite broker)
    tlt db upgrade                        run Alembic migrations to head
    tlt token create [--user NAME] [--admin [--promote]]   (an admin token only with --admin)
    tlt submit [spec.yaml] [--preset NAME] [--wait] [--idempotency-key K]   (REST client; --url/--token or
                                          TLT_URL/TLT_TOKEN)
    tlt jobs | tlt logs [-f] JOB | tlt metrics JOB | tlt cancel JOB | tlt download JOB --kind policy -o DIR
    tlt train ... | tlt selfcheck ... | tlt bench ...       (the training library's own commands)

Exit status: 0 ok; 1 the job failed; 3 the job was cancelled; 4 the server refused or could not be reached, or the
input was unusable (errors name the URL; a refused spec lists `field: message` lines).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("tlt")
EXIT_FAILED, EXIT_CANCELLED, EXIT_API = 1, 3, 4
LIBRARY_COMMANDS = {  # subcommands owned by worker/tlt: module path, each exposes main(argv) -> int
    "train": ("worker.tlt.train", "train a job spec without the service"),
    "selfcheck": ("worker.tlt.selfcheck", "check the engine against transformers"),
    "bench": ("worker.tlt.bench", "run a benchmark"),
}
# `tlt bench decode` is the decode benchmark at real shapes (random weights, roofline, HF peer)
BENCH_SUBCOMMANDS = {"decode": "worker.tlt.bench_decode"}


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def exit_code_for(status: str) -> int:
    return {"succeeded": 0, "failed": EXIT_FAILED, "cancelled": EXIT_CANCELLED}.get(status, 0)


# ------------------------------------------------------------ local commands (talk to the database directly)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from backend.core.config import get_settings
    from backend.core.migrate import upgrade

    settings = get_settings()
    settings.ensure_dirs()
    upgrade(settings.database_url)
    _out(f"database at head: {settings.database_url}")
    return 0


def create_token(user: str, admin: bool, name: str = "", promote: bool = False) -> str:
    """A new token's secret. An admin token only when `admin`; for an existing non-admin user that also needs
    `promote` (else crud.Conflict)."""
    from backend.core.config import get_settings
    from backend.persistence import crud
    from backend.persistence.db import make_engine, make_session_factory

    engine = make_engine(get_settings().database_url)
    try:
        with make_session_factory(engine)() as s:
            _, secret = crud.create_token(s, user, admin=admin, name=name, promote=promote)
    finally:
        engine.dispose()
    return secret


def cmd_token_create(args: argparse.Namespace) -> int:
    from backend.persistence import crud

    if args.promote and not args.admin:
        sys.stderr.write("tlt: --promote makes the user an admin and needs --admin\n")
        return 2
    try:
        _out(create_token(args.user, args.admin, args.name, promote=args.promote))
    except crud.Conflict as e:
        sys.stderr.write(f"tlt: {e}\n")
        return EXIT_API
    return 0


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
        _out(f"TLT Studio is up: {url}  (API docs {url}/docs; database {settings.database_url})")
        rc = 0
        if args.demo:
            rc = _run_demo(url, settings.artifacts, procs, args.demo_spec)
            if args.exit:
                return rc
        _out("Ctrl-C stops the API and the worker.")
        while all(p.poll() is None for p in procs):
            time.sleep(1.0)
        _out("the API or the worker exited; stopping")
        return EXIT_API
    except KeyboardInterrupt:
        _out("stopping")
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
    _out(f"dashboard:  {url}/#/jobs/{job['id']}  (sign in with this token)\ntoken:      {token}\n"
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
                _out(f"job {job['id']} [{time.monotonic() - t0:.0f}s]: {line['line']}")
        new = client.job(job["id"])["status"]
        if new != status:
            _out(f"job {job['id']} [{time.monotonic() - t0:.0f}s]: {new}")
        status = new
    final = client.job(job["id"])
    _out(f"demo job {final['id']} {final['status']} in {time.monotonic() - t0:.0f} s"
         + (f": {final['reason']}" if final.get("reason") else ""))
    for text in demo_summary(client.metrics(job["id"], names=list(DEMO_SUMMARY))):
        _out(text)
    for art in client.artifacts(job["id"]):
        _out(f"  {art['kind']:<11} step {art['step']}  {art['size']:>12} bytes  sha256 {art['sha256'][:16]}...")
    return exit_code_for(final["status"])


DEMO_SUMMARY = {  # metric -> what the demo's closing lines call it
    "reward/mean": "reward (mean of the step's responses)",
    "sd/on_fraction": "SD on (share of decode steps)",
    "sd/accept_len": "SD accept length (tokens per verify)",
    "drafter/acc": "EAGLE drafter top-1 accuracy",
}


def demo_summary(history: dict[str, Any]) -> list[str]:
    """One line per DEMO_SUMMARY metric the job reported: its first and last step's values."""
    out = []
    for series in history.get("series", []):
        pts = [p for p in series["points"] if p["value"] is not None]
        if series["name"] in DEMO_SUMMARY and pts:
            first, last = pts[0], pts[-1]
            out.append(f"  {DEMO_SUMMARY[series['name']]:<40} step {first['step']}: {first['value']:.3f}  ->  "
                       f"step {last['step']}: {last['value']:.3f}")
    return out


# ------------------------------------------------------------ REST client commands


def _client(args: argparse.Namespace) -> Any:
    from worker.client import TltClient

    return TltClient(args.url, args.token)


def submitted_spec(path: str | None, preset_name: str | None) -> dict[str, Any]:
    """The spec to submit: a file, a named preset (worker/tlt/config.py PRESETS), or the file's keys over the preset.
    Not validated here: the API validates it and answers a 422 naming each bad field."""
    import yaml

    from worker.tlt.config import PRESETS
    from worker.tlt.spec_file import merge_spec

    if preset_name is not None and preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; known: {', '.join(PRESETS)}")
    spec: dict[str, Any] = dict(PRESETS[preset_name]) if preset_name else {}
    if path:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a job spec is a mapping of JobSpec fields")
        spec = merge_spec(spec, loaded)
    return spec


def cmd_submit(args: argparse.Namespace) -> int:
    if not args.spec and not args.preset:
        raise ValueError("give a spec file, --preset NAME, or both (the file's keys override the preset's)")
    spec = submitted_spec(args.spec, args.preset)
    c = _client(args)
    job = c.submit(spec, idempotency_key=args.idempotency_key)
    _out(f"job {job['id']} {job['status']}")
    if not args.wait:
        return 0
    final = c.wait(job["id"], poll_s=args.poll)
    _out(f"job {final['id']} {final['status']}" + (f": {final['reason']}" if final.get("reason") else ""))
    return exit_code_for(final["status"])


def cmd_jobs(args: argparse.Namespace) -> int:
    for j in _client(args).jobs(status=args.status, owner=args.owner, limit=args.limit):
        _out(f"{j['id']:>6}  {j['status']:<11} attempt {j['attempt']}  {j['owner']:<12} {j['name']}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from worker.client import FINAL_STATUSES

    c = _client(args)
    if not args.follow:
        for line in c.logs(args.job):
            _out(line["line"])
        job = c.job(args.job)
        if job["status"] in FINAL_STATUSES:  # the outcome last, as `-f` prints it
            _out(LogOrder.text({"to_status": job["status"], "reason": job.get("reason")}))
        return 0
    lines = LogOrder()
    status = "unknown"
    for ev in c.stream(args.job):
        if ev.event == "log":
            for text in lines.log(ev.data):
                _out(text)
        elif ev.event == "event" and ev.data.get("to_status"):
            lines.transition(ev.data)
        elif ev.event == "end":
            status = ev.data.get("status") or status
            break
    for text in lines.end():
        _out(text)
    return exit_code_for(status)


class LogOrder:
    """Log lines and status transitions of a followed job, printed in the order they happened. The stream sends each
    batch's transitions before its log lines (one table after the other), so a transition is held until a log line
    written after it arrives, and a final one (succeeded / failed / cancelled) until the stream ends: it prints last."""

    def __init__(self) -> None:
        self.pending: list[dict[str, Any]] = []

    @staticmethod
    def text(event: dict[str, Any]) -> str:
        return f"-- {event['to_status']}" + (f": {event['reason']}" if event.get("reason") else "")

    def transition(self, event: dict[str, Any]) -> None:
        self.pending.append(event)

    def log(self, line: dict[str, Any]) -> list[str]:
        """The texts to print now: held transitions that happened before this line (final ones stay), then it."""
        from worker.client import FINAL_STATUSES

        at = line.get("created_at") or ""
        due = [e for e in self.pending if e["to_status"] not in FINAL_STATUSES and e.get("created_at", "") <= at]
        self.pending = [e for e in self.pending if e not in due]
        return [self.text(e) for e in due] + [line["line"]]

    def end(self) -> list[str]:
        """The transitions still held, in order (the final status last)."""
        out, self.pending = [self.text(e) for e in self.pending], []
        return out


def cmd_metrics(args: argparse.Namespace) -> int:
    hist = _client(args).metrics(args.job, names=args.names)
    for series in hist["series"]:
        pts = series["points"]
        last = f"  last step {pts[-1]['step']}: {_fmt(pts[-1]['value'])}" if pts else ""
        _out(f"{series['name']:<32} {len(pts):>6} points{last}")
    return 0


def _fmt(value: float | None) -> str:
    return "nan" if value is None else f"{value:.6g}"  # the API serves non-finite values as null


def cmd_cancel(args: argparse.Namespace) -> int:
    job = _client(args).cancel(args.job)
    _out(f"job {job['id']} {job['status']}")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    path = _client(args).download(args.job, args.kind, Path(args.output))
    _out(str(path))
    return 0


# ------------------------------------------------------------ parser


def _preset_names() -> list[str]:
    from worker.tlt.config import PRESETS

    return sorted(PRESETS)



def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tlt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start the API and one worker on embedded defaults")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--demo", action="store_true", help="also create an admin token and run the demo-cpu preset")
    p.add_argument("--exit", action="store_true", help="with --demo: stop everything once the demo job is final")
    p.add_argument("--demo-spec", help="with --demo: run this spec file instead of the demo-cpu preset")
    p.set_defaults(func=cmd_up)

    db = sub.add_parser("db", help="database schema").add_subparsers(dest="db_command", required=True)
    db.add_parser("upgrade", help="apply Alembic migrations up to head").set_defaults(func=cmd_db_upgrade)

    tok = sub.add_parser("token", help="API tokens").add_subparsers(dest="token_command", required=True)
    p = tok.add_parser("create", help="create a token (the user is created if new) and print it")
    p.add_argument("--user", default="admin")
    p.add_argument("--admin", action="store_true", help="an admin token (without it: an ordinary user's token, even "
                   "for an admin user); a new user is created as an admin")
    p.add_argument("--promote", action="store_true", help="with --admin: make an existing non-admin user an admin")
    p.add_argument("--name", default="cli", help="a label for the token")
    p.set_defaults(func=cmd_token_create)

    def client_parser(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--url", default=os.environ.get("TLT_URL", "http://127.0.0.1:8000"))
        p.add_argument("--token", default=os.environ.get("TLT_TOKEN"))
        return p

    p = client_parser("submit", "submit a job spec (YAML or JSON), a named preset, or a file over a preset")
    p.add_argument("spec", nargs="?", help="job spec file; with --preset its keys override the preset's")
    p.add_argument("--preset", help="start from a named preset: " + ", ".join(_preset_names()))
    p.add_argument("--wait", action="store_true", help="wait for the final state; exit 1 if failed, 3 if cancelled")
    p.add_argument("--idempotency-key")
    p.add_argument("--poll", type=float, default=2.0, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_submit)
    p = client_parser("jobs", "list jobs, newest first")
    p.add_argument("--status")
    p.add_argument("--owner")
    p.add_argument("--limit", type=int, default=50)
    p.set_defaults(func=cmd_jobs)
    p = client_parser("logs", "print a job's log lines")
    p.add_argument("job", type=int)
    p.add_argument("-f", "--follow", action="store_true", help="stream until the job is final")
    p.set_defaults(func=cmd_logs)
    p = client_parser("metrics", "summarise a job's metric series")
    p.add_argument("job", type=int)
    p.add_argument("--names", nargs="*")
    p.set_defaults(func=cmd_metrics)
    p = client_parser("cancel", "cancel a job")
    p.add_argument("job", type=int)
    p.set_defaults(func=cmd_cancel)
    p = client_parser("download", "download a job's newest artifact of a kind (checked against its sha256)")
    p.add_argument("job", type=int)
    p.add_argument("--kind", choices=["policy", "drafter", "checkpoint", "tensorboard"], required=True)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_download)

    for name, (_, help_) in LIBRARY_COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)  # listed in --help; argv goes to the library untouched
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "alembic.runtime.plugins"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCH_SUBCOMMANDS:
        return int(importlib.import_module(BENCH_SUBCOMMANDS[argv[1]]).main(argv[2:]))
    if argv and argv[0] in LIBRARY_COMMANDS:
        module = importlib.import_module(LIBRARY_COMMANDS[argv[0]][0])
        return int(module.main(argv[1:]))
    args = build_parser().parse_args(argv)
    import httpx

    from worker.client import ApiError

    try:
        return int(args.func(args))
    except httpx.TransportError as e:  # refused, timed out, name not resolved: say where we tried
        sys.stderr.write(f"tlt: cannot reach the TLT API at {getattr(args, 'url', '?')}: {e}\n")
        return EXIT_API
    except (ApiError, httpx.HTTPError) as e:
        sys.stderr.write(f"tlt: {e}\n")
        return EXIT_API
    except (OSError, ValueError) as e:  # unreadable spec file, unknown preset, unwritable output directory
        sys.stderr.write(f"tlt: {e}\n")
        return EXIT_API


if __name__ == "__main__":
    sys.exit(main())
