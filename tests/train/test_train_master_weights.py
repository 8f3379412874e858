"""fp32 master weights for bf16 training: a steady update far below a bf16 ulp is rounded away by plain bf16 AdamW
but accumulates through the fp32 copy; the trainer turns them on for bf16 models by default, keeps the live bf16
weights equal to the rounded copies, checkpoints the copies and resumes a bf16 run exactly.

Run: python -m pytest tests/train/test_train_master_weights.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from worker.tlt.build import build_trainer
from worker.tlt.config import AlgorithmConfig
from worker.tlt.file_reporter import FileReporter, read_metrics
from worker.tlt.rl.checkpoint import load_checkpoint
from worker.tlt.rl.optim import MasterWeights, build_optimizer, use_master_weights
from worker.tlt.train import run


def _steps_of_constant_gradient(master: bool, steps: int = 100, lr: float = 1e-4) -> tuple[float, MasterWeights]:
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    mw = MasterWeights([w], enabled=master)
    opt = build_optimizer(mw.train_params, AlgorithmConfig(learning_rate=lr))
    for _ in range(steps):
        (w.float().sum()).backward()  # gradient 1 on every element: Adam moves each weight by ~lr per step
        mw.accumulate_grads()
        opt.step()
        mw.write_back()
        opt.zero_grad(set_to_none=True)
    return float(w.detach()[0]), mw


def test_tiny_updates_accumulate_only_with_master_weights() -> None:
    plain, _ = _steps_of_constant_gradient(master=False)
    assert plain == 1.0  # 1 - 1e-4 rounds back to 1.0 in bf16 (ulp below 1.0 is 2^-8), a hundred times over
    with_master, mw = _steps_of_constant_gradient(master=True)
    assert float(mw.train_params[0].detach()[0]) == pytest.approx(0.99, abs=1e-4)  # the fp32 copy took every step
    assert with_master == pytest.approx(0.99, abs=2e-3)  # and the bf16 weight follows it (rounded)
    assert mw.train_params[0].dtype == torch.float32


def test_master_grads_sum_micro_batches_in_fp32() -> None:
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    mw = MasterWeights([w], enabled=True)
    for g in (1.0, 1e-3):  # 1 + 1e-3 is 1.0 in bf16; in fp32 it is not
        (w.float() * g).sum().backward()
        mw.accumulate_grads()
        assert w.grad is None  # moved, so the next backward starts from zero
    grad = mw.train_params[0].grad
    assert grad is not None and float(grad[0]) == pytest.approx(1.001, abs=1e-6)


def _bf16_spec(toy_spec, **algo):
    spec = toy_spec({"learning_rate": 1e-3, **algo}, max_steps=3, save_steps=1, save_total_limit=3)
    return spec.model_copy(update={"model": spec.model.model_copy(update={"dtype": "bfloat16"})})


def test_trainer_uses_master_weights_for_bf16_by_default(tmp_path: Path, toy_spec) -> None:
    spec = _bf16_spec(toy_spec)
    trainer, _ = build_trainer(spec, FileReporter(tmp_path))
    assert trainer.model.head_weight.dtype == torch.bfloat16
    assert use_master_weights(trainer.model, spec.algorithm) and trainer.master.pairs
    trainer.step()
    for p, m in trainer.master.pairs:
        assert m.dtype == torch.float32 and torch.equal(p, m.to(torch.bfloat16))
    trainer.close()
    off = spec.model_copy(update={"algorithm": spec.algorithm.model_copy(update={"fp32_master_weights": False})})
    trainer, _ = build_trainer(off, FileReporter(tmp_path))
    assert not trainer.master.enabled and not trainer.master.pairs
    assert all(p.dtype == torch.bfloat16 for p in trainer.optimizer.param_groups[0]["params"])
    trainer.close()
    assert "without fp32 master weights" in (tmp_path / "train.log").read_text()


def test_bf16_run_resumes_exactly_from_its_master_weights(tmp_path: Path, toy_spec) -> None:
    spec = _bf16_spec(toy_spec)
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(spec, full, FileReporter(full))
    short = spec.model_copy(update={"max_steps": 1})
    run(short, cut, FileReporter(cut))  # stops after step 1 with a checkpoint (and an export)
    assert "master_weights" in load_checkpoint(cut / "checkpoints/step-1").extra
    run(spec, cut, FileReporter(cut))  # resumes from step-1 to step 3
    a, b = read_metrics(full), read_metrics(cut)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert a[-1]["metrics"]["reward/mean"] == b[-1]["metrics"]["reward/mean"]
    wa = load_file(str(full / "checkpoints/step-3/model.safetensors"))
    wb = load_file(str(cut / "checkpoints/step-3/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    ma = load_checkpoint(full / "checkpoints/step-3").extra["master_weights"]["fp32"]
    mb = load_checkpoint(cut / "checkpoints/step-3").extra["master_weights"]["fp32"]
    assert all(torch.equal(x, y) for x, y in zip(ma, mb, strict=True))
