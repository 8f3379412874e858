"""Shared by the multi-GPU tests: a reporter that records every call, weight snapshots, and spawning one process per
rank that leaves its results in rank{r}.pt (`python -m pytest` puts the repo root on sys.path: `tests.multigpu.ranks`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from worker.tlt.multigpu import launch


class Quiet:
    """A Reporter that keeps everything in memory."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str) -> Any:
        if name in ("metrics", "histogram", "log", "artifact", "samples"):
            return lambda *args: self.calls.append((name, args))
        raise AttributeError(name)

    def should_stop(self) -> bool:
        return False


def params_of(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def spawn_ranks(fn: Callable[[int, str, str], None], out: Path, world: int) -> list[dict[str, Any]]:
    """Run fn(rank, init_method, out_dir) in `world` spawned processes (gloo on CPU); each saves out/rank{r}.pt."""
    mp.start_processes(fn, args=(f"tcp://127.0.0.1:{launch.free_port()}", str(out)), nprocs=world, join=True,
                       start_method="spawn")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
