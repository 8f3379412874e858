"""Storage is bounded (finding 8 of the service-safety review): the checkpoint writer keeps at most
TLT_KEEP_LAST_CHECKPOINTS (default 2) whatever the spec asks; a user over TLT_USER_QUOTA_GB gets a 409 at submit
(SQLite and Postgres); and a checkpoint is read with weights_only=True, so a planted pickle cannot run code.

Run: python -m pytest tests/backend/test_cp_safety_storage.py -q
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from backend.main import create_app
from backend.persistence import crud
from tests.specs import api_spec
from worker.tlt.rl import checkpoint as ck

SPEC = api_spec(name="t")


def _save(root: Path, step: int, keep: int) -> Path:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    return ck.save_checkpoint(root, step, model=model, optimizer=opt, scheduler=sched, rng=ck.capture_rng(None),
                              trainer_state={"data_pos": step}, extra={"adaptive": {"n": step}}, keep=keep)


def test_retention_caps_what_the_spec_keeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ck.KEEP_ENV, raising=False)
    for step in range(1, 6):
        _save(tmp_path / "a", step, keep=3)  # the spec's save_total_limit default is 3
    assert [s for s, _ in ck.list_checkpoints(tmp_path / "a")] == [4, 5]  # default cap 2
    monkeypatch.setenv(ck.KEEP_ENV, "1")
    for step in range(1, 4):
        _save(tmp_path / "b", step, keep=3)
    assert [s for s, _ in ck.list_checkpoints(tmp_path / "b")] == [3]
    monkeypatch.setenv(ck.KEEP_ENV, "5")
    for step in range(1, 5):
        _save(tmp_path / "c", step, keep=2)  # the spec's own smaller limit still holds
    assert [s for s, _ in ck.list_checkpoints(tmp_path / "c")] == [3, 4]
    monkeypatch.setenv(ck.KEEP_ENV, "0")
    with pytest.raises(ValueError, match="TLT_KEEP_LAST_CHECKPOINTS must be a whole number >= 1"):
        _save(tmp_path / "d", 1, keep=2)


def test_checkpoint_round_trip_with_weights_only(tmp_path: Path) -> None:
    """Everything a resume needs (optimizer, scheduler, every RNG incl. NumPy's) loads under weights_only=True."""
    np.random.seed(7)
    path = _save(tmp_path, 1, keep=2)
    expected = np.random.rand(3)
    loaded = ck.load_checkpoint(path)
    ck.restore_rng(loaded.rng, None)
    assert np.array_equal(np.random.rand(3), expected)
    assert loaded.optimizer["state"] and loaded.extra == {"adaptive": {"n": 1}} and loaded.trainer_state["data_pos"] == 1


class _Planted:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("code ran while loading a checkpoint",))


def test_a_planted_pickle_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 1, keep=2)
    torch.save({"x": _Planted()}, path / "extra.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        ck.load_checkpoint(path)


def test_quota_over_is_409_at_submit(cp_backend) -> None:
    settings = cp_backend.settings.model_copy(update={"user_quota_gb": 1.0})
    alice, bob = cp_backend.token("alice"), cp_backend.token("bob")
    with TestClient(create_app(settings)) as client:
        h = {"Authorization": f"Bearer {alice}"}
        jid = client.post("/api/v1/jobs", json={"spec": SPEC}, headers={**h, "Idempotency-Key": "k1"}).json()["id"]
        with cp_backend.session() as s:
            for i, size in enumerate((600 << 20, 500 << 20)):  # 1.07 GiB of checkpoints
                crud.register_artifact(s, jid, kind="checkpoint", path=f"/a/{jid}/step-{i}", is_dir=True, size=size,
                                       sha256="0" * 64, step=i)
            s.commit()
        r = client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h)
        assert r.status_code == 409
        assert r.json()["detail"].startswith(
            "storage quota exceeded: your jobs hold 1.07 GB of artifacts, your datasets 0.00 GB (quota 1 GB")
        replay = client.post("/api/v1/jobs", json={"spec": SPEC}, headers={**h, "Idempotency-Key": "k1"})
        assert (replay.status_code, replay.json()["id"]) == (200, jid)  # a replay is not a new submission
        assert client.post("/api/v1/jobs", json={"spec": SPEC},
                           headers={"Authorization": f"Bearer {bob}"}).status_code == 201  # per user
        with cp_backend.session() as s:  # retention deleted one: under the quota again
            crud.mark_artifacts_deleted(s, [crud.list_artifacts(s, jid)[0].id])
            s.commit()
        assert client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).status_code == 201
