"""A small REST client of the TLT Studio API (httpx), used by the `tlt` CLI and CI scripts.

    c = TltClient("http://127.0.0.1:8000", token)
    job = c.submit(spec_dict, idempotency_key="ci-123"); final = c.wait(job["id"])
    c.download(job["id"], "policy", Path("out/policy"))
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})


class ApiError(RuntimeError):
    """A refusal by the API: its status code, the request's URL and the server's `detail`, readable as text (a 422's
    validation errors one `field: message` line each)."""

    def __init__(self, status_code: int, detail: Any, url: str = "") -> None:
        where = f" from {url}" if url else ""
        super().__init__(f"HTTP {status_code}{where}: {format_detail(detail)}")
        self.status_code, self.detail, self.url = status_code, detail, url


def format_detail(detail: Any) -> str:
    """FastAPI's error detail as text: a validation error list becomes `field: message` lines (the field path without
    the `body` prefix: `spec.algorithm.max_completion_length: Input should be greater than or equal to 1`)."""
    if isinstance(detail, list) and all(isinstance(e, dict) and "msg" in e for e in detail):
        lines = []
        for e in detail:
            loc = [str(p) for p in e.get("loc", ()) if p not in ("body", "query", "path", "header")]
            lines.append(f"{'.'.join(loc) or '(request)'}: {e['msg']}")
        return "\n" + "\n".join(f"  {line}" for line in lines)
    return str(detail)


@dataclass(frozen=True)
class SseEvent:
    event: str
    id: str | None
    data: Any


class TltClient:
    def __init__(self, url: str, token: str | None, timeout: float = 30.0, transport: httpx.BaseTransport | None = None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url.rstrip("/") + "/api/v1", headers=headers, timeout=timeout,
                                 transport=transport)

    def close(self) -> None:
        self.http.close()

    def _json(self, resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            raise ApiError(resp.status_code, detail, str(resp.request.url))
        return resp.json()

    # ------------------------------------------------------------ jobs

    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._json(self.http.post("/jobs", json={"spec": spec}, headers=headers))

    def job(self, job_id: int) -> dict[str, Any]:
        return self._json(self.http.get(f"/jobs/{job_id}"))

    def jobs(self, status: str | None = None, owner: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """Newest first, following the cursor until `limit` jobs were read."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while len(out) < limit:
            params: dict[str, Any] = {"limit": min(100, limit - len(out))}
            params.update({k: v for k, v in (("status", status), ("owner", owner), ("cursor", cursor)) if v})
            page = self._json(self.http.get("/jobs", params=params))
            out.extend(page["items"])
            cursor = page.get("next_cursor")
            if not cursor:
                break
        return out

    def cancel(self, job_id: int) -> dict[str, Any]:
        return self._json(self.http.post(f"/jobs/{job_id}/cancel"))

    def retry(self, job_id: int) -> dict[str, Any]:
        return self._json(self.http.post(f"/jobs/{job_id}/retry"))

    def wait(self, job_id: int, poll_s: float = 1.0, timeout_s: float | None = None) -> dict[str, Any]:
        """Poll until the job is succeeded, failed or cancelled; returns the final job."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job["status"] in FINAL_STATUSES:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['status']} after {timeout_s} s")
            time.sleep(poll_s)

    # ------------------------------------------------------------ telemetry

    def events(self, job_id: int) -> list[dict[str, Any]]:
        return self._json(self.http.get(f"/jobs/{job_id}/events"))

    def logs(self, job_id: int, after_id: int = 0) -> list[dict[str, Any]]:
        return self._json(self.http.get(f"/jobs/{job_id}/logs", params={"after_id": after_id}))

    def metrics(self, job_id: int, names: list[str] | None = None, points: int | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"names": names} if names else {}
        if points:
            params["points"] = points
        return self._json(self.http.get(f"/jobs/{job_id}/metrics", params=params))

    def stream(self, job_id: int, last_event_id: str | None = None) -> Iterator[SseEvent]:
        """The job's SSE stream (metrics, events, logs) until its `end` event."""
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        with self.http.stream("GET", f"/jobs/{job_id}/stream", headers=headers, timeout=None) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._json(resp)
            yield from parse_sse(resp.iter_lines())

    def follow(self, job_id: int, last_event_id: str | None = None, reconnect_for_s: float = 60.0,
               retry_s: float = 1.0) -> Iterator[SseEvent]:
        """The job's stream until its `end` event, surviving API restarts: a dropped connection (or a stream the
        server closed early) is reopened with Last-Event-ID = the id of the last event received, so every event
        arrives exactly once. Gives up (the last error) when no connection succeeds for `reconnect_for_s`."""
        down_since: float | None = None
        while True:
            try:
                for ev in self.stream(job_id, last_event_id):
                    down_since = None
                    if ev.id is not None:
                        last_event_id = ev.id
                    yield ev
                    if ev.event == "end":
                        return
            except httpx.TransportError:  # refused while the API restarts, or cut mid-stream
                now = time.monotonic()
                down_since = now if down_since is None else down_since
                if now - down_since > reconnect_for_s:
                    raise
            except ApiError as e:
                if e.status_code < 500 or down_since is not None and time.monotonic() - down_since > reconnect_for_s:
                    raise
                down_since = down_since or time.monotonic()  # the API is up but its database is not (yet)
            time.sleep(retry_s)  # the stream's own `retry:` hint is 1 s

    # ------------------------------------------------------------ artifacts

    def artifacts(self, job_id: int, kind: str | None = None) -> list[dict[str, Any]]:
        return self._json(self.http.get(f"/jobs/{job_id}/artifacts", params={"kind": kind} if kind else {}))

    def download(self, job_id: int, kind: str, out_dir: Path) -> Path:
        """The newest artifact of `kind`, checked against its sha256: a directory is unpacked into `out_dir` (as
        `out_dir/<its name>`), a file is written into it. Returns the directory or file written."""
        arts = self.artifacts(job_id, kind)
        if not arts:
            raise ApiError(404, f"job {job_id} has no {kind} artifact")
        art = max(arts, key=lambda a: (a["step"] if a["step"] is not None else -1, a["id"]))
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".part", delete=False) as tmp:
            sha = hashlib.sha256()
            with self.http.stream("GET", f"/artifacts/{art['id']}/download", timeout=None) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    self._json(resp)
                for chunk in resp.iter_bytes(1 << 20):
                    sha.update(chunk)
                    tmp.write(chunk)
        part = Path(tmp.name)
        try:
            if sha.hexdigest() != art["sha256"]:
                raise ApiError(502, f"artifact {art['id']}: sha256 mismatch ({sha.hexdigest()} != {art['sha256']})")
            # The store's tars carry mtime 0 (so their sha256 is fixed); files get the artifact's creation time.
            stamp = _utc(art["created_at"]).timestamp()
            if art["is_dir"]:
                with tarfile.open(part) as tf:
                    tf.extractall(out_dir, filter="data")
                    names = tf.getnames()
                written = [out_dir / n for n in names]
                for path in sorted(written, reverse=True):  # children before their directory
                    os.utime(path, (stamp, stamp), follow_symlinks=False)
                tops = {Path(n).parts[0] for n in names if Path(n).parts}
                return out_dir / tops.pop() if len(tops) == 1 else out_dir  # the store's tars hold one directory
            target = out_dir / art["name"]
            part.replace(target)
            os.utime(target, (stamp, stamp))
            return target
        finally:
            part.unlink(missing_ok=True)


def _utc(iso: str) -> datetime:
    """An API timestamp; one without a zone (SQLite drops it) is UTC, as the server writes it."""
    t = datetime.fromisoformat(iso)
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def parse_sse(lines: Iterator[str]) -> Iterator[SseEvent]:
    """Server-sent events from text lines (the subset the API emits: event, id, data, comments)."""
    event, ident, data = "message", None, list[str]()
    for line in lines:
        if not line:
            if data:
                text = "\n".join(data)
                try:
                    payload: Any = json.loads(text)
                except ValueError:
                    payload = text
                yield SseEvent(event, ident, payload)
            event, data = "message", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            event = value
        elif field == "id":
            ident = value
        elif field == "data":
            data.append(value)
