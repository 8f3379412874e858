"""Launch configs of the fused kernels per (GPU name, kernel, weight shape), tuned at a shape's first use.

A kernel asks `config_for(kernel, N, K, device, launch)`: the config is the first of
  1. this process's table for the GPU (filled from `<KernelConfig.tuning_dir>/<GPU name>.json` and from `SEEDS`),
  2. a tuning run, on CUDA with `KernelConfig.tune` and outside any graph capture: every candidate of `candidates()`
     is launched on the call's own inputs (`launch(cfg)`), timed as CUDA-graph replays of back-to-back launches
     (what the decode graph sees), and the fastest is kept in the table and written to the file,
  3. the default rule (`common.default_config`).
The key holds the weight shape only, never the token count M, so every row's result stays bit-identical whatever the
batch (kernels/common.py). Tuning runs on the first launch's M clipped to decode size where the kernel allows it.

`linear_residual` is also timed against torch (cuBLAS `F.linear`, + the residual): where torch is faster by
`TORCH_MARGIN` the shape is marked, and with `KernelConfig.cublas_where_faster` (off by default) `prefers_torch`
tells the kernel to run torch for it. Off by default because such a shape's rows depend on the batch the way cuBLAS's
kernel choice does: greedy SD stays exact in exact arithmetic, but in bf16 a verify and a decode may round apart.

`SEEDS` holds configs measured by bench/kernel_sweep.py for SmolLM2-135M on an H200: its kernels are a few
microseconds, where a first-use timing of single launches would be noise against the sweep's. Run the tests:
`python -m pytest tests/kernels/test_kernels_tuned.py -q`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import astuple, dataclass, field, replace
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources

from worker.tlt.kernels.common import Config, default_config
from worker.tlt.kernels.settings import current

log = logging.getLogger(__name__)

Key = tuple[str, int, int]  # (kernel, N, K)
Launch = Callable[[Config], object]  # one launch of the kernel on the call's inputs with this config
TORCH_MARGIN = 0.9  # torch replaces the fused kernel where it takes at most this fraction of the kernel's time
LAUNCHES, REPLAYS = 10, 3  # back-to-back launches per captured graph, graph replays timed

SEEDS: dict[str, dict[Key, Config]] = {
    "NVIDIA H200": {  # SmolLM2-135M (bench/kernel_sweep.py)
        ("attention", 3, 64): Config(128, 64, 8, 2, 128),
        ("linear_residual", 49152, 576): Config(64, 64, 2, 3),
        ("linear_residual", 576, 1536): Config(16, 256, 2, 3),
        ("linear_residual", 576, 576): Config(16, 256, 2, 3),
        ("norm_gate_up", 1536, 576): Config(32, 256, 4, 2),
        ("qkv_rope", 960, 576): Config(32, 256, 4, 3),
    },
}


@dataclass
class Table:
    """One GPU's configs: seeded, read from its file, or tuned in this process."""

    gpu: str
    path: Path
    configs: dict[Key, Config] = field(default_factory=dict)
    torch_faster: set[Key] = field(default_factory=set)  # linear_residual shapes where cuBLAS won

    def save(self) -> Path:
        """Write the table; atomically (a rename), as several processes on one host may tune and read at once."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"configs": {",".join(map(str, k)): list(astuple(c)) for k, c in sorted(self.configs.items())},
                "torch_faster": sorted(",".join(map(str, k)) for k in self.torch_faster)}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, self.path)
        return self.path


_TABLES: dict[str, Table] = {}


def _key(text: str) -> Key:
    kernel, n, k = text.split(",")
    return kernel, int(n), int(k)


def file_for(gpu: str, directory: Path | None = None) -> Path:
    return (directory or current().tuning_dir) / (re.sub(r"[^A-Za-z0-9]+", "_", gpu).strip("_") + ".json")


def table(gpu: str) -> Table:
    """This process's table for `gpu`: seeds, then the file's entries over them (read once per process and
    tuning directory)."""
    path = file_for(gpu)
    tab = _TABLES.get(gpu)
    if tab is None or tab.path != path:
        tab = _TABLES[gpu] = Table(gpu, path, dict(SEEDS.get(gpu, {})))
        if path.exists():
            try:
                data = json.loads(path.read_text())
                configs = {_key(k): Config(*v) for k, v in data.get("configs", {}).items()}
                faster = {_key(k) for k in data.get("torch_faster", [])}
            except (ValueError, TypeError, AttributeError) as e:  # unreadable: tune again, and overwrite it then
                log.warning("ignoring the tuned configs in %s: %s", path, e)
                configs, faster = {}, set()
            tab.configs.update(configs)
            tab.torch_faster.update(faster)
    return tab


def forget() -> None:
    """Drop every in-memory table (tests; a changed tuning directory is noticed without this)."""
    _TABLES.clear()


def candidates(kernel: str, n: int, k: int) -> list[Config]:
    """The configs a first use times (the default rule's first). GEMV-like kernels at decode size are bound by weight
    bytes: wide K tiles keep loads in flight, narrow N tiles spread the rows over the SMs; more warps and stages
    deepen the pipeline where K is long."""
    first = default_config(kernel, n, k)
    bk = max(16, min(256, triton.next_power_of_2(k)))
    pf = first.prefetch  # the rule's L2 prefetch choice, and the default tile with the other choice
    if kernel == "attention":
        more = [Config(64, k, 4, 2, 0), Config(64, k, 4, 2, 128), Config(128, k, 8, 2, 128), Config(64, k, 4, 3, 256)]
    elif kernel == "qkv_rope":
        more = [replace(first, prefetch=not pf), Config(16, bk, 4, 3, prefetch=pf), Config(32, bk, 4, 3, prefetch=pf),
                Config(64, min(bk, 128), 4, 3, prefetch=pf), Config(16, bk, 8, 4, prefetch=pf)]
    else:  # linear_residual, norm_gate_up (two weight tiles per step: half the tile)
        wide = kernel == "linear_residual"
        more = [replace(first, prefetch=not pf), Config(16, bk, 4, 3, prefetch=pf), Config(32, bk, 4, 4, prefetch=pf),
                Config(16, min(2 * bk, 512), 8, 3, prefetch=pf), Config(64 if wide else 32, 128, 4, 4, prefetch=pf),
                Config(32, bk, 8, 3, prefetch=pf), Config(64, bk, 8, 4, prefetch=pf)]
    out = [first]
    for c in more:
        if c not in out and c.block_k <= max(16, triton.next_power_of_2(k)):
            out.append(c)
    return out


def time_us(fn: Callable[[], object], launches: int = LAUNCHES, replays: int = REPLAYS) -> float:
    """Microseconds per call of `fn` (CUDA work only): `launches` calls captured in one graph, `replays` replays
    timed after one warm replay. The first call runs eagerly (compiles, first-use allocations)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (launches * replays)


def tune(tab: Table, key: Key, launch: Launch, torch_launch: Callable[[], object] | None) -> Config:
    """Time the candidates of `key` (and torch's equivalent) on the call's inputs; keep and save the winner."""
    timed: dict[Config, float] = {}
    default, *_ = cands = candidates(*key)
    for c in cands:
        try:
            timed[c] = time_us(functools.partial(launch, c))
        except OutOfResources as e:  # e.g. H100's shared memory is smaller than the widest tile a candidate asks
            log.info("skipped %s for %s: %s", c, key, e)
    if not timed:
        raise RuntimeError(f"no launch config of {key} fits {tab.gpu}")
    best = min(timed, key=timed.__getitem__)
    tab.configs[key] = best
    note = ""
    if torch_launch is not None:
        t_torch = time_us(torch_launch)
        if t_torch <= TORCH_MARGIN * timed[best]:
            tab.torch_faster.add(key)
        note = f", torch {t_torch:.1f} us"
    log.info("tuned %s on %s: %s %.1f us (default %.1f us%s)", key, tab.gpu, best, timed[best],
             timed.get(default, float("nan")), note)
    try:
        tab.save()
    except OSError as e:  # a read-only home still runs with the tuned configs in memory
        log.warning("tuned configs not saved to %s: %s", tab.path, e)
    return best


def config_for(kernel: str, n: int, k: int, device: torch.device | None = None, launch: Launch | None = None,
               torch_launch: Callable[[], object] | None = None) -> Config:
    """The launch config of `kernel` at weight shape (n, k) on `device` (module docstring). `launch` lets a first use
    on CUDA tune; `torch_launch` (linear_residual) times torch's equivalent as well."""
    if device is None or device.type != "cuda":
        return default_config(kernel, n, k)
    tab = table(torch.cuda.get_device_name(device))
    key = (kernel, n, k)
    cfg = tab.configs.get(key)
    if cfg is not None:
        return cfg
    if launch is None or not current().tune or torch.cuda.is_current_stream_capturing():
        return default_config(kernel, n, k)
    return tune(tab, key, launch, torch_launch)


def prefers_torch(kernel: str, n: int, k: int, device: torch.device) -> bool:
    """Whether this shape runs torch: tuning found cuBLAS faster (only ever for linear_residual) and
    KernelConfig.cublas_where_faster allows it."""
    if device.type != "cuda" or not current().cublas_where_faster:
        return False
    return (kernel, n, k) in table(torch.cuda.get_device_name(device)).torch_faster


def describe(device: torch.device) -> str:
    """Which configs the kernels launch with on `device` (for benchmark notes)."""
    if device.type != "cuda":
        return "the default rule (not on CUDA)"
    tab = table(torch.cuda.get_device_name(device))
    where = f"{tab.path}" if tab.path.exists() else "no file yet"
    return f"tuned per shape ({len(tab.configs)} shapes, {len(tab.torch_faster)} on torch; {where})"
