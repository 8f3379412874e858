"""One rank's view of a multi-GPU job: process group, device, the rendezvous store, and the few collectives the
multigpu package uses (object gathers for small records, a float all-reduce, a module broadcast).

    ctx = DistContext.init(rank, world, init_method="env://", device_type="cuda", local_rank=rank % gpus_per_host)
    ...
    ctx.close(wait_for_peers=True)  # after the rank's work ended normally

Backend: NCCL on CUDA (rank r drives cuda:local_rank, its index on its host), gloo on CPU (the CI tests). The store (TCPStore of the rendezvous)
carries the harvest phase's "my shard is done" counters: store ops are host round trips that never enter the NCCL
stream, so an idle rank can poll them between drafter steps without a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass
class DistContext:
    rank: int
    world: int
    device: torch.device
    store: dist.Store

    @classmethod
    def init(cls, rank: int, world: int, init_method: str, device_type: str, timeout_s: float = 1800.0,
             local_rank: int | None = None) -> DistContext:
        """Join the process group. CUDA: pins cuda:local_rank (default: rank) first, so `torch.cuda.current_device()`
        is this rank's GPU."""
        if device_type == "cuda":
            index = rank if local_rank is None else local_rank
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
            backend = "nccl"
        else:
            device = torch.device("cpu")
            backend = "gloo"
        timeout = timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous(init_method, rank, world, timeout=timeout))
        store.set_timeout(timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)  # NCCL: bound to this GPU
        return cls(rank, world, device, store)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self, *, wait_for_peers: bool = False) -> None:
        """Leave the process group. `wait_for_peers` (a rank whose work ended normally): meet the others first, since
        a rank that tears its gloo connections down while a peer still holds its own can abort that peer
        (std::terminate in gloo's teardown); after a failure there may be no peer left to meet."""
        if dist.is_initialized():
            if wait_for_peers:
                dist.barrier()
            dist.destroy_process_group()

    # ------------------------------------------------------------------------------------------------ collectives
    def all_gather_objects(self, obj: T) -> list[T]:
        """Every rank's `obj` (picklable, small: records and metric dicts), in rank order."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: T | None, src: int) -> T:
        box: list[Any] = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def all_reduce_floats(self, values: list[float], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on some rank (a collective decision, e.g. stop)."""
        return self.all_reduce_floats([float(flag)], dist.ReduceOp.MAX)[0] > 0

    @torch.no_grad()
    def broadcast_module(self, module: torch.nn.Module, src: int = 0) -> None:
        """Every parameter and buffer of `module` := rank `src`'s, in place (shared/tied tensors sent once)."""
        seen: set[int] = set()
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            dist.broadcast(t.data, src=src)

    def barrier(self) -> None:
        dist.barrier()
