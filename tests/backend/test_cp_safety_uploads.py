"""Uploaded datasets get the spec's input rules, on SQLite and Postgres: a JSONL row with a lone surrogate
(`"q\\ud800x"`, in a value or a key) or NaN / Infinity, or a parquet row with a NaN answer, is a 422 naming the row
(they were stored, and the job failed later in the tokenizer); a file over the row cap or with a row over the length
cap is a 413 naming the setting. Nothing is stored for a refused upload.

Run: python -m pytest tests/backend/test_cp_safety_uploads.py -q
"""

from __future__ import annotations

import io
import os
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fastapi.testclient import TestClient

from backend.main import create_app


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _upload(client: TestClient, h: dict[str, str], name: str, body: bytes):  # type: ignore[no-untyped-def]
    return client.post("/api/v1/datasets", files={"file": (name, body)}, headers=h)


def _nothing_stored(client: TestClient, h: dict[str, str], cp_backend: Any) -> None:
    assert client.get("/api/v1/datasets", headers=h).json() == []
    assert os.listdir(cp_backend.settings.artifacts / "datasets") == []


def test_jsonl_rows_with_surrogates_or_non_finite_numbers_are_refused(cp_client: TestClient, cp_backend: Any) -> None:
    h = auth(cp_backend.token())
    lines = [
        r'{"question": "fine", "answer": "1"}',
        r'{"question": "q\ud800x", "answer": "2"}',  # a lone surrogate in the prompt
        r'{"question": "q", "answer": NaN}',
        r'{"question": "q", "answer": Infinity}',
        r'{"question": "q", "answer": "5", "note": -Infinity}',  # in a column the job does not use: still refused
        r'{"question": "q", "answer": "6", "\udc00": 1}',  # in a key
        r'{"question": [{"role": "user", "content": "x\udfff"}], "answer": "7"}',  # inside chat messages
        r'{"question": "also fine", "answer": "8"}',
    ]
    r = _upload(cp_client, h, "d.jsonl", "\n".join(lines).encode())
    assert r.status_code == 422, r.text
    d = r.json()["detail"]
    assert d["bad_rows"] == [2, 3, 4, 5, 6, 7] and "6 bad row(s) of 8" in d["message"]
    assert d["errors"][0] == r"row 2: text 'q\ud800x' is not valid unicode (a lone surrogate)"
    assert d["errors"][1] == "row 3: NaN is not a number JSON allows"
    assert d["errors"][2] == "row 4: Infinity is not a number JSON allows"
    assert d["errors"][3] == "row 5: -Infinity is not a number JSON allows"
    assert d["errors"][4].startswith("row 6: text") and d["errors"][5].startswith("row 7: text 'x\\udfff'")
    _nothing_stored(cp_client, h, cp_backend)
    ok = "\n".join([lines[0], lines[-1]]).encode()
    assert _upload(cp_client, h, "d.jsonl", ok).status_code == 201


def test_parquet_non_finite_answer_is_refused(cp_client: TestClient, cp_backend: Any) -> None:
    h = auth(cp_backend.token())
    buf = io.BytesIO()
    pq.write_table(pa.table({"question": ["a", "b", "c"], "answer": [1.0, float("nan"), float("inf")]}), buf)
    r = _upload(cp_client, h, "p.parquet", buf.getvalue())
    assert r.status_code == 422 and r.json()["detail"]["bad_rows"] == [2, 3]
    assert r.json()["detail"]["errors"] == ["row 2: column 'answer': nan is not a finite number",
                                            "row 3: column 'answer': inf is not a finite number"]
    _nothing_stored(cp_client, h, cp_backend)


def test_row_count_and_row_length_caps(cp_backend: Any) -> None:
    settings = cp_backend.settings.model_copy(update={"max_dataset_rows": 3, "max_dataset_row_kb": 1})
    with TestClient(create_app(settings)) as client:
        h = auth(cp_backend.token())
        row = b'{"question": "q", "answer": "1"}\n'
        assert _upload(client, h, "d.jsonl", row * 3).status_code == 201
        r = _upload(client, h, "d.jsonl", row * 4)
        assert r.status_code == 413 and "more than 3 rows (TLT_MAX_DATASET_ROWS)" in r.json()["detail"]
        long_row = b'{"question": "' + b"q" * 2000 + b'", "answer": "1"}\n'
        r = _upload(client, h, "d.jsonl", row + long_row)
        assert r.status_code == 413 and "row 2 is longer than 1024 bytes" in r.json()["detail"]
        buf = io.BytesIO()
        pq.write_table(pa.table({"question": ["a"] * 4, "answer": ["1"] * 4}), buf)
        r = _upload(client, h, "p.parquet", buf.getvalue())
        assert r.status_code == 413 and "TLT_MAX_DATASET_ROWS" in r.json()["detail"]
        assert len(client.get("/api/v1/datasets", headers=h).json()) == 1
        assert len(os.listdir(settings.artifacts / "datasets")) == 1
