"""Exact resume with the online drafter: a training run with EAGLE SD stopped after step 2 and resumed from its
checkpoint ends with bit-identical drafter weights, optimizer, buffer and metrics to the uninterrupted run; and
restoring only weights + optimizer (what checkpoints held before) is not enough for that.

Run: python -m pytest tests/drafter/test_drafter_resume.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.specs import toy_spec
from worker.tlt.config import JobSpec
from worker.tlt.file_reporter import FileReporter, read_metrics
from worker.tlt.job_spec_translate import drafter_config
from worker.tlt.model.transformer import Transformer
from worker.tlt.rl.checkpoint import latest_checkpoint
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.drafter.online import OnlineDrafter
from worker.tlt.train import run

VOLATILE = ("timing_s/", "perf/", "harvest/")  # wall-clock metrics differ between any two runs


def _spec() -> JobSpec:
    return toy_spec(
        name="toy-eagle",
        algorithm={"max_completion_length": 12},
        rollout={"speculative": "on", "draft_depth": 3},
        drafter={"kind": "eagle1", "max_train_steps_per_rl_step": 3, "buffer_gb": 0.002, "learning_rate": 1e-2},
        max_steps=4,
    )


class StopAfter(FileReporter):
    def __init__(self, run_dir: Path, n: int) -> None:
        super().__init__(run_dir)
        self.n = n

    def should_stop(self) -> bool:
        return len(read_metrics(self.run_dir)) >= self.n


def _equal(a: Any, b: Any, path: str = "") -> None:
    """Deep bit-equality of nested checkpoint state (tensors, dicts, lists, numbers)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def _drafter_state(run_dir: Path, step: int) -> dict[str, Any]:
    return torch.load(run_dir / f"checkpoints/step-{step}/extra.pt", weights_only=False)["drafter"]


def test_resumed_run_trains_the_drafter_bit_identically(tmp_path: Path) -> None:
    spec = _spec()
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(spec, full, FileReporter(full))
    run(spec, cut, StopAfter(cut, 2))
    ck = latest_checkpoint(cut / "checkpoints")
    assert ck is not None and ck.name == "step-2"
    run(spec, cut, FileReporter(cut))  # resumes from step-2
    a, b = read_metrics(full), read_metrics(cut)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        sa = {k: v for k, v in ra["metrics"].items() if not k.startswith(VOLATILE)}
        sb = {k: v for k, v in rb["metrics"].items() if not k.startswith(VOLATILE)}
        assert sa == sb, ra["step"]
    assert a[-1]["metrics"]["drafter/steps"] == 12 and "sd/accept_len" in a[-1]["metrics"]
    s2, s4 = _drafter_state(full, 2), _drafter_state(full, 4)
    assert not torch.equal(s2["trainer"]["drafter"]["fc.weight"], s4["trainer"]["drafter"]["fc.weight"])
    assert int((s4["buffer"]["step"] >= 0).sum()) > 0 and set(s4["buffer"]["step"].tolist()) == {2, 3}  # rollouts 0..3
    volatile = ("idle_gpu_s", "used_gpu_s")
    sa, sb = _drafter_state(full, 4), _drafter_state(cut, 4)
    for st in (sa, sb):
        for k in volatile:
            st["trainer"].pop(k)
        st.pop("tail_s")
    _equal(sa, sb)


def _loop(od: OnlineDrafter, target: Transformer, steps: range) -> None:
    eng = Engine(target, eos_ids=(257,), config=EngineConfig(max_len=48, max_slots=4, seed=7),
                 controller=AdaptiveSd.fixed(chain_arm("eagle", 3)), proposers={"eagle": od.proposer},
                 hidden_hook=od.hidden_hook)
    reqs = [Request([5, 6, 7, 8], RequestSampling(temperature=1.0, max_new_tokens=16, n=2)),
            Request([9, 10, 11], RequestSampling(temperature=1.0, max_new_tokens=16, n=2))]
    for step in steps:
        od.begin_rollout(step)
        eng.gen.manual_seed(100 + step)  # the rollout's own stream is the trainer's to restore (rl/checkpoint.py)
        od.observe_rollout(eng.generate(reqs))
        od.after_update(step, [])


def test_weights_and_optimizer_alone_do_not_resume_exactly(tiny_target: Transformer) -> None:
    """The buffer rows and the generators matter: the old checkpoint content (weights, AdamW, counters) resumes to
    different drafter weights one RL step later; the full state resumes to the same."""
    spec = JobSpec.model_validate({"model": {"builtin": "tiny-llama"}, "rollout": {"sd_on_below": 8},
                                   "drafter": {"kind": "eagle1", "max_train_steps_per_rl_step": 4,
                                               "buffer_gb": 0.01, "learning_rate": 1e-2}})
    ref = OnlineDrafter(drafter_config(spec), tiny_target)
    _loop(ref, tiny_target, range(2))
    state = ref.state_dict()
    t = state["trainer"]
    old_format = {"drafter": t["drafter"], "optimizer": t["optimizer"], "steps": t["steps"], "version": t["version"]}
    _loop(ref, tiny_target, range(2, 3))
    full, partial = OnlineDrafter(drafter_config(spec), tiny_target), OnlineDrafter(drafter_config(spec), tiny_target)
    full.load_state_dict(state)
    partial.load_state_dict(old_format)
    _loop(full, tiny_target, range(2, 3))
    _loop(partial, tiny_target, range(2, 3))
    want = ref.train_drafter.state_dict()
    assert all(torch.equal(full.train_drafter.state_dict()[k], v) for k, v in want.items())
    assert not all(torch.equal(partial.train_drafter.state_dict()[k], v) for k, v in want.items())
