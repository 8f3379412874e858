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
import os

from worker.cli.admin import cmd_db_upgrade, cmd_token_create
from worker.cli.jobs import cmd_cancel, cmd_download, cmd_jobs, cmd_logs, cmd_metrics, cmd_submit
from worker.cli.up import cmd_up

LIBRARY_COMMANDS = {  # subcommands owned by worker/tlt: module path, each exposes main(argv) -> int
    "train": ("worker.tlt.train", "train a job spec without the service"),
    "selfcheck": ("worker.tlt.selfcheck", "check the engine against transformers"),
    "bench": ("worker.tlt.bench", "run a benchmark"),
}
# `tlt bench decode` is the decode benchmark at real shapes (random weights, roofline, HF peer)
BENCH_SUBCOMMANDS = {"decode": "worker.tlt.bench_decode"}


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
        p.add_argument("--url", default=os.environ.get("TLT_URL", "http://127.0.0.1:8000"),
                       help="the TLT Studio API (default: $TLT_URL, else http://127.0.0.1:8000)")
        p.add_argument("--token", default=os.environ.get("TLT_TOKEN"),
                       help="API token, from `tlt token create` (default: $TLT_TOKEN)")
        return p

    p = client_parser("submit", "submit a job spec (YAML or JSON), a named preset, or a file over a preset")
    p.add_argument("spec", nargs="?", help="job spec file; with --preset its keys override the preset's")
    p.add_argument("--preset", help="start from a named preset: " + ", ".join(_preset_names()))
    p.add_argument("--wait", action="store_true", help="print each step's line as the job runs (as `tlt logs -f`), "
                   "then its final state; exit 1 if failed, 3 if cancelled")
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
    p.add_argument("-o", "--output", required=True, help="directory to write into (created); the path written is "
                   "printed")
    p.set_defaults(func=cmd_download)

    for name, (_, help_) in LIBRARY_COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)  # listed in --help; argv goes to the library untouched
    return ap
