"""An algorithm added by another package through the `tlt.algorithms` entry-point group runs a whole job: a package
written into a temporary directory with its own dist-info (entry_points.txt declares `sign_advantage`), put on
sys.path (the installed environment's metadata stays untouched), is listed by the registry the control plane reads,
and a tiny CPU job that names it trains two steps with its advantages, checkpoints and exports the policy.

Run: python -m pytest tests/train/test_train_algorithm_plugin.py -q
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.train.conftest import make_toy_spec
from worker.tlt.file_reporter import FileReporter, read_metrics
from worker.tlt.rl.algorithms.registry import registered_names, resolve
from worker.tlt.train import run

PACKAGE = "tlt_example_algorithm"
# The example: each response's advantage is the sign of its reward against its group's mean (a pass/fail signal),
# trained with the library's clipped token loss averaged over the batch's tokens; it counts its calls.
SOURCE = '''
import torch

from worker.tlt.rl.algorithms.base import TOKEN_MEAN, Algorithm
from worker.tlt.rl.algorithms.builtin import clipped_token_loss

CALLS = []


def sign_advantages(inp, cfg):
    r = inp.rewards.view(-1, inp.group_size).float()
    CALLS.append(inp.rewards.numel())
    return torch.sign(r - r.mean(dim=1, keepdim=True)).reshape(-1)


SIGN_ADVANTAGE = Algorithm("sign_advantage", sign_advantages, clipped_token_loss, TOKEN_MEAN)
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The example package and its dist-info on sys.path; its module is forgotten afterwards."""
    site = tmp_path / "site"
    (site / PACKAGE).mkdir(parents=True)
    (site / PACKAGE / "__init__.py").write_text(SOURCE)
    info = site / f"{PACKAGE}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[tlt.algorithms]\nsign_advantage = {PACKAGE}:SIGN_ADVANTAGE\n")
    monkeypatch.syspath_prepend(str(site))
    yield
    sys.modules.pop(PACKAGE, None)


def test_an_installed_algorithm_runs_a_job(plugin: None, tmp_path: Path) -> None:
    assert "sign_advantage" in registered_names()
    algo = resolve("sign_advantage")
    calls = sys.modules[PACKAGE].CALLS  # type: ignore[attr-defined]
    spec = make_toy_spec({"name": "sign_advantage"}, max_steps=2, save_steps=2, save_total_limit=1)
    out = tmp_path / "run"
    run(spec, out, FileReporter(out))
    assert calls == [8, 8]  # one call per step, 2 prompts x 4 responses
    metrics = read_metrics(out)
    assert [r["step"] for r in metrics] == [1, 2]
    assert all(r["metrics"]["actor/grad_norm"] > 0 for r in metrics if r["metrics"]["frac_reward_zero_std"] < 1)
    rows = [row for line in (out / "samples.jsonl").read_text().splitlines() for row in json.loads(line)["rows"]]
    assert rows and {row["advantage"] for row in rows} <= {-1.0, 0.0, 1.0}  # the sign estimator's values
    assert (out / "checkpoints/step-2").is_dir() and (out / "policy/model.safetensors").exists()
    assert algo.name == "sign_advantage"
