"""`tlt submit | jobs | logs | metrics | cancel | download`: the REST client commands (worker/client.py TltClient)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from worker.cli.output import exit_code_for, out


def _client(args: argparse.Namespace) -> Any:
    from worker.client import TltClient

    return TltClient(args.url, args.token)


def submitted_spec(path: str | None, preset_name: str | None) -> dict[str, Any]:
    """The spec to submit: a file, a named preset (worker/tlt/config.py PRESETS), or the file's keys over the preset.
    Not validated here: the API validates it and answers a 422 naming each bad field."""
    import yaml

    from worker.tlt.config import PRESETS
    from worker.tlt.job_spec_file import merge_spec

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
    out(f"job {job['id']} {job['status']}")
    if not args.wait:
        return 0
    print_followed(c.follow(job["id"]))  # each step's line as it ends, as `tlt logs -f` prints them
    final = c.wait(job["id"], poll_s=args.poll)  # the stream ended with the job: this returns at once
    out(f"job {final['id']} {final['status']}" + (f": {final['reason']}" if final.get("reason") else ""))
    return exit_code_for(final["status"])


def cmd_jobs(args: argparse.Namespace) -> int:
    for j in _client(args).jobs(status=args.status, owner=args.owner, limit=args.limit):
        out(f"{j['id']:>6}  {j['status']:<11} attempt {j['attempt']}  {j['owner']:<12} {j['name']}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from worker.client import FINAL_STATUSES

    c = _client(args)
    if not args.follow:
        for line in c.logs(args.job):
            out(line["line"])
        job = c.job(args.job)
        if job["status"] in FINAL_STATUSES:  # the outcome last, as `-f` prints it
            out(LogOrder.text({"to_status": job["status"], "reason": job.get("reason")}))
        return 0
    return exit_code_for(print_followed(c.stream(args.job)))


def print_followed(events: Iterable[Any]) -> str:
    """Print a followed job's log lines and status transitions in order until its `end` event; its final status."""
    lines = LogOrder()
    status = "unknown"
    for ev in events:
        if ev.event == "log":
            for text in lines.log(ev.data):
                out(text)
        elif ev.event == "event" and ev.data.get("to_status"):
            lines.transition(ev.data)
        elif ev.event == "end":
            status = ev.data.get("status") or status
            break
    for text in lines.end():
        out(text)
    return status


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
        out(f"{series['name']:<32} {len(pts):>6} points{last}")
    return 0


def _fmt(value: float | None) -> str:
    return "nan" if value is None else f"{value:.6g}"  # the API serves non-finite values as null


def cmd_cancel(args: argparse.Namespace) -> int:
    job = _client(args).cancel(args.job)
    out(f"job {job['id']} {job['status']}")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    path = _client(args).download(args.job, args.kind, Path(args.output))
    out(f"job {args.job} {args.kind} written to {path.resolve()}")
    return 0
