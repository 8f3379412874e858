"""Host (Python) time of one speculative step, on the CPU: what leaves the GPU idle between two chain-SD steps.

    python bench/spec_host.py                                   # batch 8 depth 6, batch 1 depth 4; 64 steps each
    python bench/spec_host.py --configs 8x6 --steps 128 --json-out /tmp/spec_host.json

An engine as on the GPU path (tiny random target, EAGLE-1 chain drafter with random weights, T=1, the hidden-state
hook feeding the drafter's feature ring AND a spot-training buffer, as speculative/drafter/online.py wires it), with the two
CUDA graphs of a step (the chain draft, rollout/speculative_graphs.py's body) replaced by eager stand-ins that run the
recorded body into the same static buffers. Everything a replay does is GPU work on CUDA, so its time is taken out
of every phase: what remains is the host path from one step's read to the next step's replay. Three passes over
--steps steps at the full batch (after --warm steps), EOS off so the batch stays full:
1. time: the host thread's CPU time per phase (time.thread_time: a shared machine's other processes do not count;
   `--clock wall` for perf_counter) (context + bookkeeping = the step minus propose / verify / hook; verify = the
   proposal copied into the verify graph's buffers and its random draws), medians over the steps, the fastest of
   --repeat runs; the trainer buffer's deferred writes are timed once at the end and spread over the steps;
2. cProfile: the same host path split into Python (ours, stdlib), numpy and torch (C builtins and torch's Python
   wrappers) by tottime, and the top functions (cProfile roughly doubles Python's cost: read the split, not the sum);
3. ops: aten ops per phase (TorchDispatchMode; on CUDA each non-view op is a launch or a copy, ~5-20 us of host).
Caveats: torch ops run on the CPU here, so their time includes their (small) compute, where on CUDA a launch costs
the same whatever its size; the stand-in replays evict the caches, so the host path runs cold, as after a real
wait on the GPU it may not: per-call costs are higher than in a warm micro-benchmark (read ratios, not absolutes).
Smoke run: `python bench/spec_host.py --steps 4 --warm 1 --repeat 1` (seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from worker.tlt.model import preset, random_model
from worker.tlt.rollout import speculative_step
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.engine_state import EngineState
from worker.tlt.rollout.speculative_body import SpecOut
from worker.tlt.rollout.speculative_graphs import VerifyGraphs, _Entry
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.drafter.buffer import EngineCapture, HiddenStateBuffer
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer, EagleProposerConfig
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter

CLOCK = time.thread_time  # main(): --clock

# per step: "step" = propose + verify + hook + context+bookkeeping; "total" = step + sync (the host between replays)
TIMED = ("step", "propose", "verify", "hook", "capture", "observe", "context+bookkeeping", "sync", "total")
# the trainer buffer may defer its writes (HiddenStateBuffer.capture(defer=True)): their cost, timed once at the end
# of the measured steps, is spread over them and added to capture / hook / step / total


class Probe:
    """Phase timers (replay time excluded), a cProfile that pauses in replays, an op counter per phase."""

    def __init__(self) -> None:
        self.replay_s = 0.0  # host seconds spent inside replays so far (subtracted from enclosing phases)
        self.stack: list[str] = []
        self.cur: dict[str, float] = defaultdict(float)  # this step's seconds per phase
        self.steps: list[dict[str, float]] = []  # per full-batch step
        self.profiler: cProfile.Profile | None = None
        self.window = (0, 0)  # full-batch steps measured: [warm, warm + steps)
        self.measuring = False  # inside a measured step or the sync after it
        self.paused = False  # inside a replay
        self.flush_s = 0.0  # writing the trainer buffer's deferred captures of the measured steps, at the end

    def timed(self, name: str, fn: Callable[..., Any], *a: Any, **k: Any) -> Any:
        """fn(*a, **k) as phase `name`: host seconds minus the replays inside (plain try/finally: a generator
        context manager would add ~3 us per phase to what is measured)."""
        t0, r0 = CLOCK(), self.replay_s
        self.stack.append(name)
        try:
            return fn(*a, **k)
        finally:
            self.stack.pop()
            self.cur[name] += CLOCK() - t0 - (self.replay_s - r0)

    def replay(self, fn: Callable[[], Any]) -> Any:
        """Run a stand-in replay (GPU work on CUDA): its time leaves every enclosing phase, the profiler and the op
        counter skip it."""
        t0 = CLOCK()
        prof = self.profiler if self.measuring else None
        if prof is not None:
            prof.disable()
        self.paused = True
        try:
            return fn()
        finally:
            self.paused = False
            if prof is not None:
                prof.enable()
            self.replay_s += CLOCK() - t0

    def measure(self, on: bool) -> None:
        """Start / stop measuring (the profiler runs only over measured steps and the sync after each)."""
        if self.profiler is not None and on != self.measuring:
            self.profiler.enable() if on else self.profiler.disable()
        self.measuring = on

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        inner = getattr(owner, attr)
        setattr(owner, attr, lambda *a, **k: self.timed(name, inner, *a, **k))


EMIT_HIDDEN = speculative_step.emit_hidden  # the hook's rows of a speculative step, before any probe wraps it


class OpCounter(TorchDispatchMode):
    """aten ops per phase outside replays: (phase, op) -> count; views apart (no kernel)."""

    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe
        self.counts: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.probe.measuring and not self.probe.paused:
            ph = self.probe.stack[-1] if self.probe.stack else "(outside)"
            self.counts[(ph, "view" if getattr(func, "is_view", False) else str(func.overloadpacket))] += 1
        return func(*args, **(kwargs or {}))


class _EagerVerifyReplay:
    def __init__(self, probe: Probe, entry: _Entry, body: Callable[[], SpecOut]) -> None:
        self.probe, self.entry, self.body = probe, entry, body

    def replay(self) -> None:
        self.probe.replay(self._run)

    def _run(self) -> None:
        out = self.body()
        assert self.entry.out is not None
        for a, b in zip((self.entry.out.packed, self.entry.out.hidden, self.entry.out.kept, self.entry.out.n),
                        (out.packed, out.hidden, out.kept, out.n), strict=True):
            a.copy_(b)  # a graph's outputs are static: the caller holds these very tensors


class EagerVerifyGraphs(VerifyGraphs):
    """rollout/speculative_graphs.py with the capture replaced by an eager stand-in (same static buffers)."""

    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe

    def _record(self, state: EngineState, entry: _Entry, body: Callable[[], SpecOut]) -> None:
        entry.out = self.probe.replay(body)
        entry.graph = _EagerVerifyReplay(self.probe, entry, body)  # type: ignore[assignment]


class _EagerChainReplay:
    def __init__(self, probe: Probe, run: Callable[[], tuple[torch.Tensor, ...]], out: tuple[torch.Tensor, ...]):
        self.probe, self.run, self.out = probe, run, out

    def replay(self) -> None:
        self.probe.replay(self._run)

    def _run(self) -> None:
        for o, n in zip(self.out, self.run(), strict=True):
            o.copy_(n)


class _Done(Exception):
    """Ends generate() once the measured steps have run."""


def build(batch: int, depth: int, context: int, new_tokens: int) -> tuple[Engine, EagleProposer, Probe]:
    torch.manual_seed(0)
    target = random_model(preset("tiny-llama"), seed=0, std=0.1)
    prop = EagleProposer(EagleDrafter(target, EagleConfig()), EagleProposerConfig(context=context))
    probe = Probe()

    def record(run: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[Any, tuple[torch.Tensor, ...]]:
        out = probe.replay(run)
        return _EagerChainReplay(probe, run, out), out

    prop._record = record  # type: ignore[method-assign]
    prop._graphable = lambda bsz, ctx: ctx.hidden is None  # type: ignore[method-assign]
    buf = HiddenStateBuffer(prop.drafter.feature_dim, 64 << 20, dtype=torch.float32)
    capture = EngineCapture(buf)

    def hook(seq: list[tuple[int, int]], toks: torch.Tensor, hidden: torch.Tensor) -> None:  # speculative/drafter/online.py
        probe.timed("capture", capture, seq, toks, hidden)
        probe.timed("observe", prop.observe, seq, toks, hidden)

    eng = Engine(target, eos_ids=(), config=EngineConfig(max_len=64 + new_tokens + 16, max_slots=batch),
                 controller=AdaptiveSd.fixed(chain_arm("eagle", depth)), proposers={"eagle": prop}, hidden_hook=hook)
    eng.graph_set.verify = EagerVerifyGraphs(probe)
    inner_step = eng.speculative_step

    def step(b: int, arm: Any = None) -> Any:
        probe.cur = defaultdict(float)
        lo, hi = probe.window
        flush = getattr(buf, "flush", lambda: None)
        if len(probe.steps) == lo and b == batch:
            flush()  # the trainer buffer's deferred rows: those of the measured steps are timed at the end
        if len(probe.steps) >= hi:
            probe.measure(False)
            t0 = CLOCK()
            flush()
            probe.flush_s = CLOCK() - t0
            raise _Done
        probe.measure(b == batch and lo <= len(probe.steps) < hi)
        out = probe.timed("step", inner_step, b, arm)
        if b == batch:
            probe.steps.append(probe.cur)
        return out

    eng.speculative_step = step  # type: ignore[method-assign,assignment]
    probe.wrap(prop, "propose", "propose")
    probe.wrap(eng.verify_graphs, "run", "verify")
    speculative_step.emit_hidden = EMIT_HIDDEN  # unwrapped: an earlier run's probe must not time this one's hook
    probe.wrap(speculative_step, "emit_hidden", "hook")  # the hook's rows of a speculative step
    probe.wrap(eng, "sync", "sync")  # after the step: lands in the step record appended last (same dict)
    return eng, prop, probe


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (40 + 3 * i,), generator=g).tolist() for i in range(batch)]


def one_pass(batch: int, depth: int, a: argparse.Namespace, mode: str) -> dict[str, Any]:
    new = (a.warm + a.steps + 1) * (depth + 1)  # no row can finish before the last measured step
    eng, prop, probe = build(batch, depth, a.context, new)
    probe.window = (a.warm, a.warm + a.steps)
    reqs = [Request(p, RequestSampling(temperature=a.temperature, max_new_tokens=new)) for p in prompts(batch)]
    res: dict[str, Any] = {}
    torch.set_num_threads(1)
    counter = OpCounter(probe)
    if mode == "cprofile":
        probe.profiler = cProfile.Profile()
    with torch.no_grad(), counter if mode == "ops" else contextlib.nullcontext():
        try:
            eng.generate(reqs)
        except _Done:
            pass
        probe.measure(False)
    res["ops"] = counter.counts
    steps = probe.steps[a.warm: a.warm + a.steps]
    n = len(steps)
    res["n"] = n
    res["accept"] = eng.accept_stats.mean_accept_len
    if mode == "time":  # medians over the steps: the box is shared, single slow steps are someone else's
        for s in steps:
            s["context+bookkeeping"] = s["step"] - s["propose"] - s["verify"] - s["hook"]
            s["total"] = s["step"] + s["sync"]
        res["ms"] = {k: 1e3 * statistics.median(s.get(k, 0.0) for s in steps) for k in TIMED}
        flush = 1e3 * probe.flush_s / n  # amortized over the measured steps
        for k in ("capture", "hook", "step", "total"):
            res["ms"][k] += flush
        res["ms"]["capture flush (amortized)"] = flush
    if mode == "cprofile":
        assert probe.profiler is not None
        res["cprofile"] = split_profile(pstats.Stats(probe.profiler), n)
    return res


def _kind(func: tuple[str, int, str]) -> str:
    file, _, name = func
    if file == "~":  # C builtins: "{method 'x' of 'torch._C.TensorBase' objects}", "{built-in method torch.x}"
        if "torch" in name:
            return "torch"
        if "numpy" in name:
            return "numpy"
        return "python"
    if "/torch/" in file:
        return "torch"
    if "/numpy/" in file:
        return "numpy"
    return "python"


def split_profile(st: pstats.Stats, steps: int) -> dict[str, Any]:
    """tottime per measured step by kind, and the top functions."""
    by_kind: dict[str, float] = defaultdict(float)
    rows = []
    for func, (_, nc, tt, _, _) in st.stats.items():  # type: ignore[attr-defined]
        if func[2] in ("<method 'disable' of '_lsprof.Profiler' objects>", "<method 'enable' of '_lsprof.Profiler' "
                                                                            "objects>"):
            continue
        by_kind[_kind(func)] += tt
        rows.append((tt, nc, func))
    rows.sort(reverse=True)
    top = [{"us": 1e6 * tt / steps, "calls": nc / steps, "func": f"{f[0].split('/')[-1]}:{f[1]} {f[2]}"}
           for tt, nc, f in rows[:14]]
    return {"ms": {k: 1e3 * v / steps for k, v in by_kind.items()}, "top": top}


def measure(batch: int, depth: int, a: argparse.Namespace) -> dict[str, Any]:
    timed = [one_pass(batch, depth, a, "time") for _ in range(a.repeat)]
    best = min(timed, key=lambda r: r["ms"]["total"])  # least disturbed run of the shared box
    prof = one_pass(batch, depth, a, "cprofile")
    ops = one_pass(batch, depth, a, "ops")
    per_phase: dict[str, Counter[str]] = defaultdict(Counter)
    for (ph, op), c in ops["ops"].items():
        # ops directly under "step" are the context and bookkeeping; "step" and "total" are sums
        # (outside any phase: the generate loop between a sync and the next step, counted with the sync)
        ph = {"step": "context+bookkeeping", "(outside)": "sync"}.get(ph, ph)
        per_phase[ph][op] += c
        if ph in ("capture", "observe"):
            per_phase["hook"][op] += c
        if ph != "sync":
            per_phase["step"][op] += c
        per_phase["total"][op] += c
    n_ops = max(1, ops["n"])
    return {"batch": batch, "depth": depth, "steps": best["n"], "accept_len": best["accept"], "ms": best["ms"],
            "runs_total_ms": [r["ms"]["total"] for r in timed], "cprofile": prof["cprofile"],
            "ops": {ph: {"kernels": sum(c for op, c in cnt.items() if op != "view") / n_ops,
                         "views": cnt["view"] / n_ops,
                         "top": [(op, c / n_ops) for op, c in cnt.most_common(8) if op != "view"]}
                    for ph, cnt in per_phase.items()}}


def render(results: list[dict[str, Any]]) -> str:
    lines = ["| batch x depth | phase | host ms / step | aten ops / step (+ views) |", "|---|---|---|---|"]
    for r in results:
        ops = r["ops"]
        for ph in (*TIMED, "capture flush (amortized)"):
            if ph not in r["ms"]:
                continue
            o = ops.get(ph)
            os_ = f"{o['kernels']:.1f} (+{o['views']:.1f})" if o else ""
            indent = "&nbsp;" * (2 if ph in ("capture", "observe") else 4 if "flush" in ph else 0)
            lines.append(f"| {r['batch']}x{r['depth']} | {indent}{ph} | {r['ms'][ph]:.3f} | {os_} |")
    lines.append("")
    lines.append("Accept length (tokens per row per step): " + ", ".join(
        f"{r['batch']}x{r['depth']} {r['accept_len']:.2f}" for r in results) + "; steps measured: " + ", ".join(
        f"{r['batch']}x{r['depth']} {r['steps']}" for r in results) + ".")
    lines.append("")
    lines.append("| batch x depth | Python ms/step | numpy ms/step | torch ms/step (cProfile tottime) |")
    lines.append("|---|---|---|---|")
    for r in results:
        c = r["cprofile"]["ms"]
        lines.append(f"| {r['batch']}x{r['depth']} | {c.get('python', 0):.3f} | {c.get('numpy', 0):.3f} | "
                     f"{c.get('torch', 0):.3f} |")
    for r in results:
        lines += ["", f"Top host functions, {r['batch']}x{r['depth']} (cProfile tottime, us/step):", "",
                  "| us | calls | function |", "|---|---|---|"]
        lines += [f"| {t['us']:.1f} | {t['calls']:.1f} | `{t['func']}` |" for t in r["cprofile"]["top"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="8x6,1x4", help="batch x chain depth, comma-separated")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per config (the fastest is reported)")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread",
                    help="thread: CPU seconds of this thread (robust on a shared machine); wall: perf_counter")
    ap.add_argument("--json-out", default="")
    a = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time if a.clock == "thread" else time.perf_counter
    results = []
    for cfg in a.configs.split(","):
        b, d = (int(x) for x in cfg.split("x"))
        results.append(measure(b, d, a))
    print(render(results))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
