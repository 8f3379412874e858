"""What this worker can run, registered in the `workers` table so the API admits only specs some worker can run:
its queues, GPUs (count and the smallest one's memory), host memory and CUDA version. Probed without torch (the
Celery worker process never imports it): GPUs from `nvidia-smi`, limited to CUDA_VISIBLE_DEVICES.

    python -m worker.registry        # print what this machine would register
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable

from backend.persistence import crud
from backend.persistence.db import make_engine, make_session_factory

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 10.0
GIB = 1024**3


def host_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def _nvidia_smi(*args: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("nvidia-smi failed (%s); registering no GPU", e)
        return None


def gpus_visible(visible: str | None) -> tuple[int, float, str | None]:
    """(GPUs this worker may use, memory of the smallest in GB, CUDA version) from nvidia-smi and
    CUDA_VISIBLE_DEVICES (None: not restricted; "": no GPU)."""
    if visible is not None and not visible.strip():
        return 0, 0.0, None
    table = _nvidia_smi("--query-gpu=index,memory.total", "--format=csv,noheader,nounits")
    if not table:
        return 0, 0.0, None
    memory = {}  # index -> MiB
    for line in table.strip().splitlines():
        index, mib = (part.strip() for part in line.split(",", 1))
        memory[index] = float(mib)
    if visible is not None:
        wanted = [d.strip() for d in visible.split(",") if d.strip()]
        if all(w.isdigit() for w in wanted):
            memory = {i: m for i, m in memory.items() if i in wanted}
        else:  # GPU UUIDs: only their count matters here
            memory = dict(list(memory.items())[: len(wanted)])
    if not memory:
        return 0, 0.0, None
    banner = _nvidia_smi() or ""
    cuda = m.group(1) if (m := re.search(r"CUDA Version:\s*([\d.]+)", banner)) else None
    return len(memory), min(memory.values()) / 1024, cuda


def wait_for_worker(database_url: str, ttl_s: float, timeout_s: float = 120.0,
                    alive: Callable[[], bool] = lambda: True) -> None:
    """Return once some worker has registered (admission refuses every job before that); RuntimeError after
    `timeout_s`, or as soon as `alive()` is false (the processes being waited for exited)."""
    engine = make_engine(database_url)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError("the API or the worker exited during start-up (see its output above)")
            with make_session_factory(engine)() as s:
                if crud.live_workers(s, ttl_s):
                    return
            time.sleep(0.2)
    finally:
        engine.dispose()
    raise RuntimeError(f"no worker registered within {timeout_s:.0f} s")


def probe(queues: list[str]) -> crud.Capacity:
    gpus, gpu_gb, cuda = gpus_visible(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return crud.Capacity(queues=queues, gpus=gpus, gpu_memory_gb=round(gpu_gb, 2),
                         host_memory_gb=round(host_memory_gb(), 2), cuda=cuda)


if __name__ == "__main__":
    print(probe(["cpu", "gpu"]))  # noqa: T201 - a command's output
