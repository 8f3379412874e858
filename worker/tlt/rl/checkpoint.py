"""Checkpoints of a training run: `run_dir/checkpoints/step-N/` with everything an exact resume needs.

    path = save_parts(root, step, model=policy, parts={"optimizer": opt, "rng": RngState(gen), ...}, keep=3)
    ck = load_checkpoint(latest_checkpoint(root)); restored = restore_parts(ck, parts)

One interface for every part's state: a part is `Stateful` (`state_dict()` / `load_state_dict(state)`: the torch
convention) and is kept under its name; rl/trainer.py `GRPOTrainer.checkpoint_parts` names the job's parts (the
optimizer, LR schedule, RNG streams, trainer progress, fp32 master weights, online drafter, SD controller: its bandit
and step costs). `save_parts` writes them, `restore_parts` loads each one the checkpoint holds, in the parts' order.
`save_checkpoint` / `Checkpoint` are the same files by field (tests and tools that write one by hand).

A checkpoint directory holds model.safetensors (policy weights), the parts "optimizer", "scheduler" and "rng" in
optimizer.pt, scheduler.pt and rng.pt (torch CPU and CUDA generators, the rollout's torch.Generator, Python `random`,
NumPy), "trainer" in trainer_state.json (step, data position) and every other part in extra.pt by name:
extra["drafter"] the online drafter's exact-resume state (speculative/drafter/online.py `OnlineDrafter.state_dict`: trainable
weights, AdamW state, the spot trainer's and proposer's generators, the hidden-state buffer's live rows, the weights
the engine serves), extra["adaptive"] the SD controller's (its bandit, the cost switch's step costs, the arm shapes
it dropped), extra["master_weights"] the fp32 master copies. extra.pt is loaded onto the CPU (each owner moves its tensors back to its device), so a checkpoint written on a GPU
resumes anywhere. It is written into a
`.tmp-*` sibling and renamed into place, so a `step-N` directory is always complete; only then are the oldest
checkpoints beyond `keep` deleted, so the previous one survives until its successor exists. The operator caps `keep`
for every run with TLT_KEEP_LAST_CHECKPOINTS (default 2): a SmolLM2 checkpoint with optimizer state is ~1.6 GB.
Every .pt file is read with `torch.load(weights_only=True)` (tensors and plain containers only: loading a
checkpoint can never run code), so the RNG states are stored as tensors and plain values.
A DeepSpeed update (rl/deepspeed_update.py) has no optimizer.pt: its optimizer state (fp32 master weights, Adam
moments, each rank's shard) is DeepSpeed's own checkpoint in `root/deepspeed/step-N`, written by every rank before
rank 0 writes step-N, so a complete step-N implies a complete tag; tags without one are removed with the pruning.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file

_STEP_DIR = re.compile(r"^step-(\d+)$")
DEEPSPEED_DIR = "deepspeed"  # root/deepspeed/step-N: DeepSpeed's own checkpoint of step N (every rank's shard)
KEEP_ENV = "TLT_KEEP_LAST_CHECKPOINTS"
DEFAULT_KEEP = 2


def keep_last_checkpoints() -> int:
    """The operator's cap on checkpoints kept per run (TLT_KEEP_LAST_CHECKPOINTS, default 2)."""
    raw = os.environ.get(KEEP_ENV, "").strip() or str(DEFAULT_KEEP)
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{KEEP_ENV} must be a whole number >= 1, got {raw!r}")
    return int(raw)


class Stateful(Protocol):
    """A part whose state a checkpoint keeps (the torch convention: tensors and plain containers only)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# parts kept in a file of their own (the rest share extra.pt, by name)
OPTIMIZER, SCHEDULER, RNG, TRAINER = "optimizer", "scheduler", "rng", "trainer"


@dataclass
class Checkpoint:
    path: Path
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    trainer_state: dict[str, Any]
    extra: dict[str, Any]

    @property
    def states(self) -> dict[str, dict[str, Any]]:
        """Every part's state by name (no optimizer where DeepSpeed keeps it)."""
        own = {SCHEDULER: self.scheduler, RNG: self.rng, TRAINER: self.trainer_state}
        return {**({OPTIMIZER: self.optimizer} if self.optimizer else {}), **own, **self.extra}


class RngState:
    """Every random stream the run draws from, as one part (`capture_rng` / `restore_rng`)."""

    def __init__(self, rollout_gen: torch.Generator | None) -> None:
        self.rollout_gen = rollout_gen

    def state_dict(self) -> dict[str, Any]:
        return capture_rng(self.rollout_gen)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng(state, self.rollout_gen)


def capture_rng(rollout_gen: torch.Generator | None) -> dict[str, Any]:
    """Every random stream the run draws from."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": _numpy_state_plain(),
        "rollout": rollout_gen.get_state() if rollout_gen is not None else None,
    }


def restore_rng(state: dict[str, Any], rollout_gen: torch.Generator | None) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if rollout_gen is not None and state["rollout"] is not None:
        rollout_gen.set_state(state["rollout"])


def _numpy_state_plain() -> tuple[str, torch.Tensor, int, int, float]:
    """NumPy's global RNG state with its key array as a tensor (weights_only loading refuses NumPy arrays)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    return str(name), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def save_parts(root: Path, step: int, *, model: torch.nn.Module, parts: Mapping[str, Stateful], keep: int = 3) -> Path:
    """Write step-N with the policy's weights and every part's state under its name (see the module docstring)."""
    if SCHEDULER not in parts or RNG not in parts:
        raise ValueError("a checkpoint needs the LR schedule's and the RNG streams' state")
    states = {name: part.state_dict() for name, part in parts.items()}
    optimizer, scheduler, rng = states.pop(OPTIMIZER, None), states.pop(SCHEDULER), states.pop(RNG)
    return _write(root, step, model, optimizer, scheduler, rng, states.pop(TRAINER, {}), states, keep)


def restore_parts(ck: Checkpoint, parts: Mapping[str, Stateful]) -> list[str]:
    """Load each part's state the checkpoint holds, in the order of `parts`; returns the names it did not hold."""
    states = ck.states
    missing = []
    for name, part in parts.items():
        if name in states:
            part.load_state_dict(states[name])
        else:
            missing.append(name)
    return missing


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rng: dict[str, Any],
    trainer_state: dict[str, Any],
    extra: dict[str, Any] | None = None,
    keep: int = 3,
) -> Path:
    """Write step-N atomically, then prune to the newest `keep` (at most TLT_KEEP_LAST_CHECKPOINTS). Returns the
    checkpoint directory."""
    opt = optimizer.state_dict() if optimizer is not None else None
    return _write(root, step, model, opt, scheduler.state_dict(), rng, trainer_state, extra or {}, keep)


def _write(root: Path, step: int, model: torch.nn.Module, optimizer: dict[str, Any] | None,
           scheduler: dict[str, Any], rng: dict[str, Any], trainer_state: dict[str, Any], extra: dict[str, Any],
           keep: int) -> Path:
    keep = min(keep, keep_last_checkpoints())
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    # clone: tied weights share storage, which safetensors refuses to write twice
    weights = {k: v.detach().to("cpu").clone().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(tmp / "model.safetensors"))
    if optimizer is not None:  # None: the optimizer state is in root/deepspeed/step-N, written by every rank
        torch.save(optimizer, tmp / "optimizer.pt")
    torch.save(scheduler, tmp / "scheduler.pt")
    torch.save(rng, tmp / "rng.pt")
    torch.save(extra, tmp / "extra.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=1))
    for f in tmp.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # the same step saved again (a resumed run): swap, never leave a gap
        old = root / f".old-step-{step}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    for _, path in list_checkpoints(root)[:-keep]:
        shutil.rmtree(path)
    prune_deepspeed(root)
    return final


def prune_deepspeed(root: Path) -> None:
    """Remove DeepSpeed tags (root/deepspeed/step-N) that have no complete step-N beside them: pruned, or a save
    that stopped before its step-N was renamed into place."""
    ds_dir = root / DEEPSPEED_DIR
    if not ds_dir.is_dir():
        return
    kept = {step for step, _ in list_checkpoints(root)}
    for tag in ds_dir.iterdir():
        m = _STEP_DIR.match(tag.name)
        if tag.is_dir() and m and int(m.group(1)) not in kept:
            shutil.rmtree(tag, ignore_errors=True)  # every rank of a job may clean at once


def clean_partial(root: Path) -> None:
    """Remove leftovers of a save that was interrupted (never complete checkpoints)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and (p.name.startswith(".tmp-step-") or p.name.startswith(".old-step-")):
                shutil.rmtree(p, ignore_errors=True)
        prune_deepspeed(root)


def load_checkpoint(path: Path) -> Checkpoint:
    state = json.loads((path / "trainer_state.json").read_text())
    return Checkpoint(
        path=path,
        step=int(state["step"]),
        model=load_file(str(path / "model.safetensors")),
        optimizer=torch.load(path / "optimizer.pt", weights_only=True) if (path / "optimizer.pt").exists() else {},
        scheduler=torch.load(path / "scheduler.pt", weights_only=True),
        rng=torch.load(path / "rng.pt", weights_only=True),
        trainer_state=state,
        extra=torch.load(path / "extra.pt", weights_only=True, map_location="cpu"),
    )
