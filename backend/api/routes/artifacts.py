"""Artifacts of a job (policy, drafter, checkpoints): list, and download streamed with sha256 headers and Range
support. A directory downloads as a canonical tar stream whose size and sha256 were fixed at registration."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Header, HTTPException, Query, status
from fastapi.responses import StreamingResponse

from backend import artifact_store
from backend.api.deps import ArtifactId, CurrentUser, JobId, SessionDep, SettingsDep
from backend.persistence import crud
from backend.schemas import ArtifactPublic, errors


def _disposition(name: str) -> str:
    """An attachment header safe for any file name (quotes, newlines, non-ASCII): ASCII fallback + RFC 5987."""
    fallback = re.sub(r"[^A-Za-z0-9._-]", "_", name) or "artifact"
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(name, safe='')}"


router = APIRouter(tags=["artifacts"], responses=errors(403, 404, 409, 410, 416))


@router.get("/jobs/{job_id}/artifacts", response_model=list[ArtifactPublic])
def list_artifacts(
    job_id: JobId, session: SessionDep, user: CurrentUser,
    kind: Annotated[Literal["policy", "drafter", "checkpoint", "tensorboard"] | None, Query()] = None,
):
    crud.check_job_visible(session, user, job_id)
    return crud.list_artifacts(session, job_id, kind)


@router.get(
    "/artifacts/{artifact_id}/download", response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}, "application/x-tar": {}}},
               206: {"description": "partial content (Range)"}, 410: {"description": "deleted by retention"},
               416: {"description": "range not satisfiable"}},
)
def download(
    artifact_id: ArtifactId, session: SessionDep, user: CurrentUser, settings: SettingsDep,
    range_: Annotated[str | None, Header(alias="Range")] = None,
) -> StreamingResponse:
    art = crud.get_artifact(session, user, artifact_id)
    path = Path(art.path).resolve()
    if not path.is_relative_to(settings.artifacts):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "artifact lies outside the artifact directory")
    if not path.exists():
        raise HTTPException(status.HTTP_410_GONE, f"artifact {artifact_id} was deleted (checkpoint retention?)")
    segs = artifact_store.layout(path)
    size = artifact_store.total_size(segs)
    if size != art.size:
        raise HTTPException(status.HTTP_409_CONFLICT, f"artifact {artifact_id} changed on disk after registration")
    try:
        rng = artifact_store.parse_range(range_, size)
    except ValueError as e:
        raise HTTPException(status.HTTP_416_RANGE_NOT_SATISFIABLE, str(e),
                            headers={"Content-Range": f"bytes */{size}"}) from e
    name = path.name + (".tar" if art.is_dir else "")
    headers = {
        "Accept-Ranges": "bytes",
        "ETag": f'"{art.sha256}"',
        "X-Checksum-Sha256": art.sha256,
        "Digest": "sha-256=" + base64.b64encode(bytes.fromhex(art.sha256)).decode(),
        "Content-Disposition": _disposition(name),
    }
    start, end = rng if rng else (0, size - 1)
    headers["Content-Length"] = str(end - start + 1 if size else 0)
    code = status.HTTP_200_OK
    if rng:
        code = status.HTTP_206_PARTIAL_CONTENT
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    media = "application/x-tar" if art.is_dir else "application/octet-stream"
    body = artifact_store.iter_bytes(segs, start, end) if size else iter(())
    return StreamingResponse(body, status_code=code, media_type=media, headers=headers)
