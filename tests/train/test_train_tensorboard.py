"""TensorBoard events of a run (worker/tlt/tensorboard.py): a toy job trained through `train.run` leaves an event
file under run_dir/tensorboard whose records are intact (TFRecord framing, masked CRC-32C) and hold every step's
scalar metrics with the values the run reported, the response-length histogram and sample text; the directory is
registered as the `tensorboard` artifact.

Run: python -m pytest tests/train/test_train_tensorboard.py -q
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from worker.tlt.config import JobSpec
from worker.tlt.file_reporter import FileReporter, read_metrics
from worker.tlt.tensorboard import histogram_moments
from worker.tlt.train import run


def read_events(path: Path) -> Iterator[event_pb2.Event]:
    """Parse a TFRecord event file, checking each length and payload CRC."""
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        assert hcrc == masked_crc32c(header)
        payload = data[pos + 12 : pos + 12 + length]
        (pcrc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        assert pcrc == masked_crc32c(payload)
        pos += 16 + length
        ev = event_pb2.Event()
        ev.ParseFromString(payload)
        yield ev


def test_run_writes_step_scalars_to_tensorboard(tmp_path: Path, toy_spec: Callable[..., JobSpec]) -> None:
    spec = toy_spec(max_steps=2, save_steps=2)
    run(spec, tmp_path, FileReporter(tmp_path))
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    scalars: dict[tuple[str, int], float] = {}
    histos, texts = set(), set()
    for ev in read_events(files[0]):
        for v in ev.summary.value:
            if v.HasField("simple_value"):
                scalars[(v.tag, ev.step)] = v.simple_value
            elif v.HasField("histo"):
                histos.add((v.tag, ev.step))
                assert v.histo.num == spec.algorithm.num_generations * spec.algorithm.prompts_per_step
            elif v.tag.startswith("samples"):
                texts.add(ev.step)
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        for name in ("reward/mean", "actor/pg_loss", "response_length/mean", "timing_s/step"):
            assert scalars[(name, r["step"])] == pytest.approx(r["metrics"][name], rel=1e-6, abs=1e-6)
        finite = {k for k, v in r["metrics"].items() if v is not None}
        assert {tag for tag, step in scalars if step == r["step"]} == finite  # every finite metric, no others
    assert histos == {("response_length", 1), ("response_length", 2)}
    assert texts == {1, 2}
    arts = [json.loads(line) for line in (tmp_path / "artifacts.jsonl").read_text().splitlines()]
    assert {"kind": "tensorboard", "path": str(tmp_path / "tensorboard"), "step": 2} in arts


def test_histogram_moments_from_buckets() -> None:
    m = histogram_moments([0.0, 10.0, 20.0, 30.0], [0, 2, 1])
    assert m == {"min": 10.0, "max": 30.0, "num": 3.0, "sum": 15.0 * 2 + 25.0, "sum_squares": 225.0 * 2 + 625.0}
    assert histogram_moments([0.0, 1.0], [0])["num"] == 0.0
