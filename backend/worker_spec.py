"""The spec a worker runs: its paths checked again against the worker's own TLT_SPEC_ROOTS, and the uploaded dataset
and artifacts it names by id resolved to their stored paths with the job owner's rights (another user's is refused
as missing). The training library then sees only built-ins and paths.

    spec = runnable_spec(session, job, settings)     # raises SpecRefused with the reason (the attempt fails)
    file_guard.install(job_file_guard(spec, settings))  # every file the loaders open is judged (worker/tlt/file_guard.py)
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy.orm import Session

from backend.core.config import Settings
from backend.job_spec_paths import spec_path_errors, spec_paths
from backend.persistence import crud
from backend.persistence.models import Job
from worker.tlt.config import ArtifactRef, JobSpec
from worker.tlt.file_guard import FileGuard, inside


class SpecRefused(ValueError):
    pass


def runnable_spec(session: Session, job: Job, settings: Settings) -> JobSpec:
    spec = JobSpec.model_validate(job.spec)
    for loc, msg in spec_path_errors(spec, settings.spec_root_paths, settings.private_dirs):
        raise SpecRefused(f"{'.'.join(loc)}: {msg}")
    owner = job.owner
    if spec.dataset.dataset_id:
        try:
            ds = crud.get_dataset(session, owner, spec.dataset.dataset_id)
        except crud.NotFound as e:
            raise SpecRefused(str(e)) from None
        spec = spec.model_copy(update={"dataset": spec.dataset.model_copy(
            update={"dataset_id": None, "path": ds.path, "builtin": None})})
    if spec.model.artifact_id is not None:
        path = _artifact_path(session, job, spec.model.artifact_id, "policy")
        spec = spec.model_copy(update={"model": spec.model.model_copy(update={"artifact_id": None, "hf_dir": path})})
    if isinstance(spec.drafter.warm_start, ArtifactRef):
        path = _artifact_path(session, job, spec.drafter.warm_start.artifact_id, "drafter")
        spec = spec.model_copy(update={"drafter": spec.drafter.model_copy(update={"warm_start": path})})
    return spec


def job_file_guard(spec: JobSpec, settings: Settings) -> FileGuard:
    """The guard the job's loaders ask about each file they open: inside this worker's TLT_SPEC_ROOTS, outside its
    home and artifact store, except the uploads and artifacts `spec` (a runnable_spec) names by id. Those are the
    paths of the runnable spec that lie in private storage: a path the user named there was refused above."""
    private = settings.private_dirs
    trusted = tuple(Path(os.path.realpath(p)) for _, p in spec_paths(spec) if inside(Path(os.path.realpath(p)), private))
    return FileGuard(roots=settings.spec_root_paths, private=private, trusted=trusted)


def _artifact_path(session: Session, job: Job, artifact_id: int, kind: str) -> str:
    try:
        art = crud.get_artifact(session, job.owner, artifact_id)
    except crud.NotFound as e:
        raise SpecRefused(str(e)) from None
    if art.kind != kind or art.deleted_at is not None:
        raise SpecRefused(f"artifact {artifact_id} is not a live {kind} artifact")
    return art.path
