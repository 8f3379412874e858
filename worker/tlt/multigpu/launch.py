"""Start a multi-GPU job: N rank processes (torch.multiprocessing spawn) from the job's own process, which keeps the
job's `Reporter` and relays to it what rank 0 reports; or join a job started by torchrun or DeepSpeed's launcher.

    from worker.tlt.multigpu import launch
    launch.run(spec, run_dir, reporter)                      # spec.resources.gpus ranks, NCCL, rank r on cuda:r
    launch.run(spec, run_dir, reporter, world=2)             # CPU ranks over gloo (tests; spec.resources.gpus == 0)

    # multi-node: the same spec on every host, the launcher's host list says where (rank 0 writes run_dir)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \
        -m worker.tlt.multigpu.launch spec.yaml --run-dir runs/job
    deepspeed --hostfile hosts --module worker.tlt.multigpu.launch spec.yaml --run-dir runs/job

Why spawn from the job process rather than torchrun: the Celery worker already runs each job in a child process
that owns the job's reporter (a database writer); spawning the ranks from there keeps that one object, its
connection and the cancel flag in one place, needs no second CLI entry point, and a rank that dies takes the job
down with a traceback (ProcessContext.join re-raises it). Rendezvous is a TCP store on a free local port.
Reporting: ranks put `(method, args)` on a queue; the job process calls the reporter; `should_stop()` is polled
here and handed to the ranks as an Event, which they turn into a collective decision (data_parallel.py).
Rendezvous is torchrun's in both cases: MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK in each rank's
environment (spawned ranks get them set here; DeepSpeed reads LOCAL_RANK for its device), rank r driving
cuda:LOCAL_RANK. Under an external launcher (`main`) rank 0 reports into run_dir's files (file_reporter.py) and
every rank stops at the step after any of them sees run_dir/STOP (a shared filesystem, as the checkpoints need).
NCCL_NVLS_ENABLE defaults to 0: NVLink SHARP multicast is unavailable on the shared H200 hosts and its set-up fails.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import queue
import socket
import sys
from collections.abc import Callable
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from worker.tlt.config import JobSpec
from worker.tlt.file_reporter import FileReporter
from worker.tlt.reporting import ArtifactKind, Reporter

log = logging.getLogger(__name__)

RELAYED = ("metrics", "histogram", "log", "artifact", "samples")


class QueueReporter:
    """A rank's `Reporter`: rank 0 forwards everything to the job process; other ranks only read the cancel flag."""

    def __init__(self, channel: Any, stop: Event, forward: bool) -> None:
        self.channel, self.stop, self.forward = channel, stop, forward

    def _put(self, method: str, *args: Any) -> None:
        if self.forward:
            self.channel.put((method, args))

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self._put("metrics", step, values)

    def histogram(self, step: int, name: str, edges: list[float], counts: list[int]) -> None:
        self._put("histogram", step, name, edges, counts)

    def log(self, line: str) -> None:
        self._put("log", line)

    def artifact(self, kind: ArtifactKind, path: Path, step: int | None = None) -> None:
        self._put("artifact", kind, path, step)

    def samples(self, step: int, rows: list[dict]) -> None:
        self._put("samples", step, rows)

    def should_stop(self) -> bool:
        return self.stop.is_set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train_rank(rank: int, world: int, local_rank: int, device_type: str, spec: JobSpec, run_dir: Path,
               resume: bool, reporter_of: Callable[[bool], Reporter]) -> None:
    """One rank of a job whose rendezvous is in the environment (env://); `reporter_of(is_main)` its reporter."""
    from worker.tlt.multigpu.context import DistContext
    from worker.tlt.multigpu.data_parallel import build_rank
    from worker.tlt.rl.loop import train_loop

    if device_type == "cpu":  # ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    ctx = DistContext.init(rank, world, "env://", device_type, local_rank=local_rank)
    reporter = reporter_of(ctx.is_main)
    trainer, finished = None, False
    try:
        trainer, dp, val = build_rank(spec, reporter, ctx)
        train_loop(spec, trainer, dp, val, run_dir, reporter, resume)
        finished = True
    finally:
        if trainer is not None:
            trainer.close()
        ctx.close(wait_for_peers=finished)


def rank_main(rank: int, world: int, master_port: int, device_type: str, spec_data: dict, run_dir: str,
              resume: bool, channel: Any, stop: Event) -> None:
    """Entry point of one spawned rank (module-level: spawn imports it by name)."""
    faulthandler.enable()  # a rank killed by a signal (a C++ abort in a collective) prints its Python stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    train_rank(rank, world, rank, device_type, JobSpec.model_validate(spec_data), Path(run_dir), resume,
               lambda is_main: QueueReporter(channel, stop, forward=is_main))
    channel.close()
    channel.join_thread()  # what rank 0 reported has reached the job process
    leave(0)


def leave(code: int) -> None:
    """End a rank whose work is on disk without interpreter teardown: there the destructors of communication threads
    (gloo's, DeepSpeed's) can abort a process that finished cleanly, and the job would fail after its last step."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def relay(procs: mp.ProcessContext, channel: Any, stop: Event, reporter: Reporter) -> None:
    """Hand the ranks' reports to `reporter` until every rank has exited (re-raises a rank's failure)."""

    def drain(timeout: float) -> None:
        try:
            method, args = channel.get(timeout=timeout)
        except queue.Empty:
            return
        if method in RELAYED:
            getattr(reporter, method)(*args)

    try:
        while not procs.join(timeout=0):
            drain(0.2)
            if not stop.is_set() and reporter.should_stop():
                stop.set()
    finally:
        while True:  # whatever rank 0 put before it exited
            try:
                method, args = channel.get_nowait()
            except queue.Empty:
                break
            if method in RELAYED:
                getattr(reporter, method)(*args)


def run(spec: JobSpec, run_dir: Path, reporter: Reporter, resume: bool = True, world: int | None = None) -> None:
    """Train `spec` on `world` ranks (default spec.resources.gpus; GPUs when the spec asks for GPUs, else CPU)."""
    world = world or spec.resources.gpus
    device_type = "cuda" if spec.resources.gpus > 0 else "cpu"
    if world < 2:
        raise ValueError(f"a data-parallel job needs at least 2 ranks, got {world}")
    if device_type == "cuda" and torch.cuda.device_count() < world:
        raise RuntimeError(f"the spec asks for {world} GPUs, {torch.cuda.device_count()} visible")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned ranks
    ctx = mp.get_context("spawn")
    channel, stop = ctx.Queue(), ctx.Event()
    port = free_port()
    reporter.log(f"starting {world} ranks ({'NCCL' if device_type == 'cuda' else 'gloo'}) at 127.0.0.1:{port}")
    procs = mp.start_processes(
        rank_main, args=(world, port, device_type, spec.model_dump(mode="json"), str(run_dir), resume,
                         channel, stop),
        nprocs=world, join=False, start_method="spawn",
    )
    relay(procs, channel, stop, reporter)


class RankReporter(FileReporter):
    """A non-zero rank under an external launcher: writes nothing, reads run_dir/STOP like rank 0."""

    def _append(self, name: str, record: dict) -> None:
        pass

    def log(self, line: str) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    """One rank of a job started by torchrun or DeepSpeed's launcher (rendezvous from the environment)."""
    import argparse

    from worker.tlt.job_spec_file import load_spec

    parser = argparse.ArgumentParser(prog="python -m worker.tlt.multigpu.launch",
                                     description="One rank of a multi-GPU / multi-node TLT job (torchrun, deepspeed).")
    parser.add_argument("spec", nargs="?", help="job spec YAML (JobSpec fields)")
    parser.add_argument("--run-dir", required=True, help="output directory, shared by every host")
    parser.add_argument("--preset", default=None, help="start from a named preset")
    parser.add_argument("--no-resume", action="store_true")
    args = parser.parse_args(argv)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        parser.error(f"not started by torchrun / deepspeed: {', '.join(missing)} unset")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = load_spec(args.spec, args.preset)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device_type = "cuda" if spec.resources.gpus > 0 else "cpu"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    run_dir = Path(args.run_dir)
    train_rank(rank, world, local_rank, device_type, spec, run_dir, not args.no_resume,
               lambda is_main: FileReporter(run_dir) if is_main else RankReporter(run_dir))
    return 0


if __name__ == "__main__":
    leave(main())
