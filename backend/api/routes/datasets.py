"""Datasets: upload a JSONL or Parquet file of prompts (validated for the named columns, size-limited, counted toward
the user's TLT_USER_QUOTA_GB; bad rows are reported and nothing is kept), list, get, delete. A job uses one with
`dataset: {dataset_id: "<id>"}`."""

from __future__ import annotations

import hashlib
import uuid
from functools import partial
from pathlib import Path
from typing import Annotated

from anyio import to_process
from fastapi import APIRouter, File, Form, HTTPException, UploadFile, status

from backend import dataset_store
from backend.admission import check_quota
from backend.api.deps import CurrentUser, SessionDep, SettingsDep
from backend.persistence import crud
from backend.schemas import DatasetPublic, errors

router = APIRouter(prefix="/datasets", tags=["datasets"], responses=errors(404, 409, 413, 415))


@router.post("", status_code=status.HTTP_201_CREATED, response_model=DatasetPublic)
async def upload_dataset(
    session: SessionDep, user: CurrentUser, settings: SettingsDep,
    file: Annotated[UploadFile, File(description=".jsonl or .parquet")],
    prompt_column: Annotated[str, Form(min_length=1, max_length=100)] = "question",
    answer_column: Annotated[str, Form(min_length=1, max_length=100)] = "answer",
    name: Annotated[str | None, Form(max_length=200)] = None,
):
    """Every row needs a non-empty prompt (string or chat messages) and answer, and no row may hold NaN, Infinity or
    invalid unicode. Reject-all on any bad row (422 lists the first ones); above the size, row-count or row-length
    limits (TLT_MAX_UPLOAD_MB, TLT_MAX_DATASET_ROWS, TLT_MAX_DATASET_ROW_KB, TLT_MAX_DATASET_DECODED_MB) 413. A spec uses it as `dataset: {dataset_id: <id>, prompt_column: ...}`."""
    try:
        fmt = dataset_store.detect_format(file.filename or "")
    except ValueError as e:
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, str(e)) from e
    wanted = [prompt_column, answer_column]
    dest_dir = settings.artifacts / "datasets"
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / f"{uuid.uuid4().hex}.{fmt}"
    h, size = hashlib.sha256(), 0
    try:
        with open(dest, "wb") as out:
            while chunk := await file.read(1 << 20):
                size += len(chunk)
                if size > settings.max_upload_bytes:
                    raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                                        f"upload exceeds the limit of {settings.max_upload_bytes} bytes")
                h.update(chunk)
                out.write(chunk)
        try:
            # in a worker process: validating a large file takes seconds of pure Python, which in a thread would hold
            # the API's GIL against its event loop (the request's session holds no connection while it waits)
            report = await to_process.run_sync(partial(
                dataset_store.validate, dest, fmt, wanted, max_rows=settings.max_dataset_rows,
                max_row_bytes=int(settings.max_dataset_row_kb * 1024),
                max_decoded_bytes=int(settings.max_dataset_decoded_mb * 1024 * 1024)))
        except dataset_store.TooLarge as e:
            raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"{e}; nothing was stored") from e
        except (OSError, UnicodeDecodeError, ValueError) as e:  # pyarrow's errors are OSError/ValueError subclasses
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"cannot read the {fmt} file: {e}") from e
        if report.bad_rows:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, {
                "message": f"{report.bad_rows} bad row(s) of {report.num_rows}; nothing was stored",
                "errors": report.errors,
                "bad_rows": report.bad_row_numbers,  # row numbers (from 1; 0 = the whole file), the first ones
                "bad_columns": report.bad_columns,  # column -> how many rows have it missing or invalid
                "columns": report.columns,  # the columns the file has
            })
        check_quota(session, user, settings.user_quota_gb, adding=size)  # datasets count toward the quota (409)
        return crud.create_dataset(
            session, user, name=name or (file.filename or dest.name), format=fmt, path=str(dest), size=size,
            sha256=h.hexdigest(), num_rows=report.num_rows, columns=report.columns,
            prompt_column=prompt_column, answer_column=answer_column,
        )
    except BaseException:
        dest.unlink(missing_ok=True)  # nothing half-kept: a rejected or failed upload leaves no file
        raise


@router.get("", response_model=list[DatasetPublic])
def list_datasets(session: SessionDep, user: CurrentUser):
    return crud.list_datasets(session, user)


@router.get("/{dataset_id}", response_model=DatasetPublic)
def get_dataset(dataset_id: str, session: SessionDep, user: CurrentUser):
    return crud.get_dataset(session, user, dataset_id)


@router.delete("/{dataset_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_dataset(dataset_id: str, session: SessionDep, user: CurrentUser, settings: SettingsDep) -> None:
    """Delete one's own dataset (admins: anyone's) and its file. Refused (409) while a job that is not final names
    it: cancel or finish those first."""
    ds = crud.get_dataset(session, user, dataset_id)
    if users := crud.jobs_using_dataset(session, ds):
        raise crud.Conflict(f"dataset {dataset_id} is used by job(s) {', '.join(map(str, users))} that are queued "
                            "or running; cancel them or wait until they end")
    path = Path(ds.path)
    crud.delete_dataset(session, ds)
    if path.is_relative_to(settings.artifacts / "datasets"):  # only ever a file the upload wrote
        path.unlink(missing_ok=True)
