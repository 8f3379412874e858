"""Per-GPU launch configs: what bench/kernel_sweep.py --write-tuned saves is what config_for serves afterwards, keyed
by the weight shape; shapes the file does not hold keep the default rule; files written before Config's `split`
field existed still load (unsplit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.tlt.kernels import common
from worker.tlt.kernels.common import Config, config_for, default_config, load_tuned, save_tuned, tuned_path


def test_saved_configs_are_served_by_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(common, "TUNED", {})
    best = Config(64, 512, num_warps=8, num_stages=3)
    path = save_tuned("NVIDIA H200", {("linear_residual", 576, 1536): best})
    assert path == tuned_path("NVIDIA H200") == tmp_path / "NVIDIA_H200.json"
    assert load_tuned("NVIDIA H200") == 1
    assert config_for("linear_residual", 576, 1536) == best
    assert config_for("linear_residual", 576, 576) == default_config("linear_residual", 576, 576)
    assert load_tuned("Some Other GPU") == 0 and len(common.TUNED) == 1  # no file for it: nothing added


def test_new_fields_round_trip_and_old_files_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(common, "TUNED", {})
    split = Config(32, 64, num_warps=2, num_stages=3, split=128)
    save_tuned("GPU A", {("attention", 3, 64): split})
    assert load_tuned("GPU A") == 1 and config_for("attention", 3, 64) == split
    tuned_path("GPU B").write_text(json.dumps({"attention,2,64": [128, 64, 4, 2]}))  # four fields: an older file
    assert load_tuned("GPU B") == 1 and config_for("attention", 2, 64) == Config(128, 64, 4, 2, split=0)
