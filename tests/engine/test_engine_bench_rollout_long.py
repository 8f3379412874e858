"""bench/rollout_long.py's CPU smoke run (`--quick`): both KV layouts decode the same forced lengths, the paged one
holds more sequences at the same KV memory, and the table and JSON come out; the K/V the roofline counts is what
each decode step of a forced length attends.
Run: python -m pytest tests/engine/test_engine_bench_rollout_long.py -q"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import torch

from worker.tlt.decoding.kv_cache import bytes_per_token
from worker.tlt.model.args import preset
from worker.tlt.rollout.types import Request, RequestSampling

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_rollout_long", ROOT / "bench" / "rollout_long.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quick_run_compares_rows_and_pages(tmp_path: Path) -> None:
    out, js = tmp_path / "t.md", tmp_path / "t.json"
    assert _bench().main(["--quick", "--out", str(out), "--json-out", str(js)]) == 0
    res = json.loads(js.read_text())
    rows, paged = res["rollouts"]
    assert rows["layout"] == "rows" and paged["layout"] == "paged 16"
    assert rows["tokens"] == paged["tokens"] > 0  # the same forced lengths
    assert paged["concurrency"] > rows["rows_held"] >= rows["concurrency"]
    assert max(rows["kv_gib"], paged["kv_gib"]) <= 0.0002  # both within the same KV memory (--quick's)
    assert len(res["decode"]) == 2 and all(d["tok_s"] > 0 for d in res["decode"])
    assert "| paged 16 |" in out.read_text()
    # a decode-only run appends to the same table
    assert _bench().main(["--quick", "--no-rollout", "--append", "--out", str(out), "--json-out", str(js)]) == 0
    more = json.loads(js.read_text())
    assert len(more["rollouts"]) == 2 and len(more["decode"]) == 4


def test_kv_read_bytes_counts_each_steps_context() -> None:
    args = preset("tiny-llama")
    # the first token comes from the prefill; the decode steps of tokens 2..4 attend 4, 5 and 6 columns (their root
    # included)
    req = Request([1, 2, 3], RequestSampling(max_new_tokens=4))
    assert _bench().kv_read_bytes(args, [req], 4) == (4 + 5 + 6) * bytes_per_token(args, torch.float32)
