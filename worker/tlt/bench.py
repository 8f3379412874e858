"""`tlt bench`: benchmarks of the rollout engine that print comparable JSON.

    tlt bench rollout --model smollm2-135m-instruct --dataset gsm8k --prompts 64 --samples 8 \
        --max-new-tokens 1024 --sd off --json
    python -m worker.tlt.bench decode --model smollm2-135m-instruct --batch 1 --max-new-tokens 256 --json

(`tlt bench decode` is worker/tlt/bench_decode.py: real shapes with random weights, the roofline and HF's static
cache; the `decode` here decodes GSM8K chat prompts of a loadable model.)

`rollout`: GSM8K prompts (chat template, system prompt "Solve the math problem. Reason step by step, then give the
final answer after '####'." as the HF/TRL peer script uses), `--samples` per prompt, temperature 1.0, continuous
batching; prints time, tokens, tokens/s and response-length percentiles. Decode CUDA graphs are captured before the
timed run (capture time reported separately). `--sd on` uses the model-free n-gram drafter (chain of
`--sd-depth`); `--sd adaptive` runs the adaptive engine with the n-gram cold-start drafter: SD on below
`--sd-on-below` active sequences, the job spec's default bandit over the n-gram arms and plain decoding. Rollouts
with `--sd off|adaptive` also report the controller's metrics (`sd_metrics`: sd/*, perf/tokens_per_s_full / _tail /
_bucket/<b>) and per-bucket rows (`buckets`); SD off runs a controller pinned off, so both modes are measured alike.
`decode`: `--batch` different prompts, EOS ignored so every sequence decodes exactly `--max-new-tokens` tokens,
T=1.0 with `--top-k` (50, HF generate's default); prints decode tokens/s (prefill included, as HF generate's
figures are). Both report the decode graphs: how many, capture seconds (`capture_s`) and memory (`graph_mib`).
Both need CUDA unless `--device cpu` is given explicitly (for smoke tests only).

Also the helpers the bench/ scripts share: table cells (`fmt`, `ratio`) and, for the training benches, a
`BenchReporter` and `run_trainer_steps` (build a trainer, step it, free it before the next run).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from worker.tlt.config import BUILTIN_MODELS, JobSpec, ModelSource, RolloutConfig
from worker.tlt.model.load import load_model
from worker.tlt.model.tokenizer import TokenizerLike
from worker.tlt.model.transformer import Transformer
from worker.tlt.reporting import Reporter
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, GenerationOutput, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.arm_buckets import ONE_GPU_BUCKETS
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.control.step_costs import StepCostConfig
from worker.tlt.speculative.control.switch import SwitchConfig
from worker.tlt.speculative.proposers.ngram import NGramConfig, NGramProposer

log = logging.getLogger(__name__)
SYSTEM_PROMPT = "Solve the math problem. Reason step by step, then give the final answer after '####'."


def model_source(name: str) -> ModelSource:
    if name in BUILTIN_MODELS:
        return ModelSource(builtin=name)
    return ModelSource(gguf=name) if name.endswith(".gguf") else ModelSource(hf_dir=name)


def gsm8k_questions(dataset: str, n: int) -> list[str]:
    if dataset == "gsm8k":
        from worker.tlt.data.dataset import builtin_path

        path = builtin_path("gsm8k")
    else:
        path = Path(dataset)
    rows: list[str] = []
    with open(path) as f:
        for line in f:
            if len(rows) == n:
                break
            rows.append(json.loads(line)["question"])
    if len(rows) < n:
        raise ValueError(f"{path} has only {len(rows)} rows, {n} asked")
    return rows


def chat_prompts(tok: TokenizerLike, questions: list[str]) -> list[list[int]]:
    msgs = ([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in questions)
    return [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True)) for m in msgs]


def percentiles(lengths: list[int]) -> dict[str, float]:
    t = torch.tensor(lengths, dtype=torch.float64)
    return {"len_mean": float(t.mean()), "len_p50": float(t.quantile(0.5)), "len_p90": float(t.quantile(0.9)),
            "len_p99": float(t.quantile(0.99)), "len_max": float(t.max()), "len_min": float(t.min())}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_controller(sd: str, on_below: int = 32, seed: int = 0, costs_below: int = 0) -> AdaptiveSd | None:
    """adaptive: the job spec's defaults (bandit, patience) over the n-gram arms, SD on below `on_below` active, or
    with `costs_below` > 0 where measured step costs say it pays below that many (speculative/control/step_costs.py); off:
    pinned off, metrics only."""
    if sd == "adaptive":
        rollout = RolloutConfig(speculative="adaptive", sd_on_below=on_below, seed=seed)
        if costs_below > 0:
            return AdaptiveSd.from_spec(rollout, ["ngram"], step_costs=StepCostConfig(), sd_below=costs_below)
        return AdaptiveSd.from_spec(rollout, ["ngram"])
    if sd == "off":
        return AdaptiveSd(SwitchConfig(mode="off", on_below=on_below), None, scheme=ONE_GPU_BUCKETS)  # as adaptive
    return None


def make_engine(model: Transformer, tok: TokenizerLike, max_len: int, slots: int, sd: str, sd_depth: int,
                cuda_graphs: bool, compile_step: bool, seed: int, controller: AdaptiveSd | None = None,
                fused: bool | None = None) -> Engine:
    if sd == "on":  # the n-gram chain of sd_depth at every step
        controller = AdaptiveSd.fixed(chain_arm("ngram", sd_depth))
    cfg = EngineConfig(max_len=max_len, max_slots=slots, cuda_graphs=cuda_graphs, compile=compile_step, seed=seed,
                       fused_kernels=fused)
    return Engine(model, eos_ids=tok.eos_ids, config=cfg, controller=controller,
                  proposers={"ngram": NGramProposer(NGramConfig())})


def tiny_model_overrides(over: dict[str, Any]) -> None:
    """A training bench's spec overrides made to run in seconds on CPU (its smoke tests): the tiny random Llama on
    the toy-count task, no CUDA graphs, SD switched by the active batch alone (on CPU the cost switch rightly keeps it
    off, and the smoke tests must see SD run). `over` needs "algorithm" and "rollout" sections."""
    over["model"] = {"builtin": "tiny-llama", "dtype": "bfloat16"}
    over["dataset"] = {"builtin": "toy-count", "validation_size": 0, "system_prompt": None}
    over["algorithm"]["reward_funcs"] = ["toy_count"]
    over["resources"] = {"gpus": 0}
    over["rollout"]["cuda_graphs"] = False
    over["rollout"]["sd_switch"] = "active_batch"


def fmt(x: float | None, digits: int = 2) -> str:
    """A table cell: thousands separated, `digits` decimals below 1,000, a dash for no value."""
    if x is None:
        return "—"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:,.{digits}f}"


def ratio(num: float | None, den: float | None) -> str:
    """A table cell "N.NNx", or a dash when either side is missing."""
    return f"{num / den:.2f}x" if num and den else "—"


StepHook = Callable[[int, dict[str, float]], None]  # (step, that step's metrics)


class BenchReporter:
    """A `Reporter` for benches that step a trainer themselves: keeps each step's metrics handed to it (and passes
    them to `on_metrics`) and the log lines (also logged at INFO); writes no artifacts or samples, never stops."""

    def __init__(self, on_metrics: StepHook | None = None) -> None:
        self.steps: list[dict[str, float]] = []
        self.lines: list[str] = []
        self.on_metrics = on_metrics

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.steps.append(dict(values))
        if self.on_metrics is not None:
            self.on_metrics(step, values)

    def histogram(self, step: int, name: str, edges: list[float], counts: list[int]) -> None: ...

    def log(self, line: str) -> None:
        self.lines.append(line)
        log.info(line)

    def artifact(self, kind: str, path: Path, step: int | None = None) -> None: ...

    def samples(self, step: int, rows: list[dict]) -> None: ...

    def should_stop(self) -> bool:
        return False


def run_trainer_steps(spec: JobSpec, reporter: Reporter, on_step: StepHook) -> float:
    """Build `spec`'s trainer, run its `max_steps` steps (CUDA synchronized around each, so host timers see the GPU's
    work) handing each step's metrics to `on_step`, then close it and free its memory (CUDA cache emptied) so the
    next run starts clean. Returns the build seconds."""
    from worker.tlt.build import build_trainer  # the training stack: imported only by the training benches

    t0 = time.perf_counter()
    trainer, _ = build_trainer(spec, reporter)
    build_s = time.perf_counter() - t0
    device = torch.device(trainer.device)
    try:
        for i in range(spec.max_steps):
            _sync(device)
            metrics, _, _ = trainer.step()
            _sync(device)
            on_step(i + 1, metrics)
    finally:
        trainer.close()
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return build_s


def summarize(out: GenerationOutput, seconds: float) -> dict:
    lengths = [len(s.tokens) for s in out.sequences]
    steps = [s for s in out.steps if s.kind != "prefill"]
    res = {"seconds": seconds, "sequences": len(lengths), "tokens": sum(lengths),
           "tokens_per_s": sum(lengths) / seconds, "steps": len(steps),
           "prefill_s": sum(s.seconds for s in out.steps if s.kind == "prefill"),
           "finish_stop": sum(s.finish_reason == "stop" for s in out.sequences)}
    res.update(percentiles(lengths))
    return res


def bench_rollout(model: Transformer, tok: TokenizerLike, prompts: list[list[int]], samples: int, max_new: int,
                  temperature: float, sd: str = "off", sd_depth: int = 4, cuda_graphs: bool = True,
                  compile_step: bool = False, seed: int = 0, top_k: int = 50, sd_on_below: int = 32,
                  fused: bool | None = None, sd_costs_below: int = 0) -> dict:
    dev = model.head_weight.device
    max_len = max(len(p) for p in prompts) + max_new
    ctl = make_controller(sd, sd_on_below, seed, sd_costs_below)
    engine = make_engine(model, tok, max_len, len(prompts) * samples, sd, sd_depth, cuda_graphs, compile_step, seed,
                         ctl, fused)
    params = RequestSampling(temperature=temperature, top_k=top_k, max_new_tokens=max_new, n=samples)
    reqs = [Request(p, params) for p in prompts]
    warm_up(engine, reqs, max_len)
    _sync(dev)
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    _sync(dev)
    res = summarize(out, time.perf_counter() - t0)
    res.update(graph_stats(engine), sd=sd)
    if ctl is not None:
        res.update(sd_metrics=out.sd_metrics, buckets=out.sd_buckets)
    return res


def warm_up(engine: Engine, reqs: list[Request], max_len: int) -> float:
    """The same untimed warm-up for every mode before a timed `engine.generate(reqs)`: the decode / verify / draft
    graph captures, then one generate of the same requests cut at their first token, which pays the prefill
    kernels' compilation and the prefill graph captures of exactly the chunks the timed run will replay (else the
    first mode measured pays them: 1.26 s of prefill against 0.06 s on an H200). Returns the seconds spent."""
    t0 = time.perf_counter()
    params = reqs[0].params
    engine.warmup(sum(r.params.n for r in reqs), max_len, params=params)
    # plain, without the adaptive controller: prefill does not depend on it, the first-token run's decode steps (over
    # rows already finished) must not reach its bandit or step costs as zero-token observations, nor its hidden
    # states a drafter
    engine.generate([dataclasses.replace(r, params=dataclasses.replace(r.params, max_new_tokens=1)) for r in reqs],
                    plain=True)
    _sync(engine.device)
    return time.perf_counter() - t0


def graph_stats(engine: Engine) -> dict:
    """How many decode graphs the engine holds, their capture seconds (compile included) and memory."""
    g = engine.graphs
    if g is None:
        return {"graphs": 0, "capture_s": 0.0, "graph_mib": 0.0}
    return {"graphs": len(g), "capture_s": g.capture_seconds, "graph_mib": g.pool_bytes / 2**20}


def bench_decode(model: Transformer, tok: TokenizerLike, prompts: list[list[int]], max_new: int,
                 cuda_graphs: bool = True, compile_step: bool = False, repeats: int = 2, top_k: int = 50,
                 fused: bool | None = None) -> dict:
    """Every sequence decodes exactly max_new tokens (no EOS) at T=1.0 with `top_k`; best of `repeats` timed runs
    after a warm-up (graph capture, and compile with `compile_step`, happen before timing)."""
    dev = model.head_weight.device
    max_len = max(len(p) for p in prompts) + max_new
    engine = make_engine(model, tok, max_len, len(prompts), "off", 0, cuda_graphs, compile_step, 0, fused=fused)
    params = RequestSampling(temperature=1.0, top_k=top_k, max_new_tokens=max_new, eos_ids=())
    engine.warmup(len(prompts), max_len, batches=[len(prompts)], params=params)  # no sequence ends early
    reqs = [Request(p, params) for p in prompts]
    best, prefill_s = float("inf"), 0.0
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        out = engine.generate(reqs)
        _sync(dev)
        if time.perf_counter() - t0 < best:
            best = time.perf_counter() - t0
            prefill_s = sum(s.seconds for s in out.steps if s.kind == "prefill")
    tokens = sum(len(s.tokens) for s in out.sequences)
    return {"batch": len(prompts), "new_tokens": max_new, "seconds": best, "tokens": tokens,
            "tokens_per_s": tokens / best, "top_k": top_k, "compiled": compile_step, "prefill_s": prefill_s,
            "step_ms": 1e3 * best / max_new, "replay_ms": replay_ms(engine), "kernel_configs": kernel_configs(engine),
            **graph_stats(engine)}


def kernel_configs(engine: Engine) -> str:
    """How the engine's cached forward ran: torch, the large-model forward (cuBLAS GEMMs + Triton), or the fused
    kernels with tuned or default launch configs."""
    if not engine.step.fused:
        return "torch forward"
    from worker.tlt.kernels.gemm_forward import prefers_gemm
    from worker.tlt.kernels.tuning import describe

    model = engine.model
    if prefers_gemm(model.args, model.head_weight.element_size()):
        return "cuBLAS GEMMs + Triton glue and attention"
    return "fused kernels, " + describe(engine.device)


def replay_ms(engine: Engine, n: int = 50) -> float | None:
    """GPU milliseconds of one decode step: back-to-back replays of the widest captured decode graph (noise refill
    included), timed with CUDA events. Against the decode loop's ms per step it says how much the host adds."""
    graphs = engine.graphs
    if graphs is None or len(graphs) == 0:
        return None
    batch, tk, mode = max(graphs.keys(), key=lambda key: (key[0], key[1]))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graphs.run(batch, tk, mode)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tlt bench", description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["rollout", "decode"])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="builtin name, HF dir or .gguf")
    ap.add_argument("--dataset", default="gsm8k", help="gsm8k or a JSONL path with a `question` field")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1, help="decode: sequences decoded together")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=1.0)
    # HF generate samples with its generation_config's top_k=50 unless told otherwise: the same law for a fair race.
    ap.add_argument("--top-k", type=int, default=50, help="0 = full vocabulary")
    ap.add_argument("--sd", choices=["off", "on", "adaptive"], default="off")
    ap.add_argument("--sd-depth", type=int, default=4)
    ap.add_argument("--sd-on-below", type=int, default=32, help="adaptive: SD on below this many active sequences")
    ap.add_argument("--sd-costs-below", type=int, default=0,
                    help="adaptive: SD where measured step costs say it pays, below this many active; 0 = threshold")
    ap.add_argument("--device", default=None, help="default cuda; cpu only when asked (smoke tests)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step before graph capture")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    a = ap.parse_args(argv)
    device = a.device or "cuda"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("tlt bench needs CUDA (pass --device cpu for a smoke test)")
    torch.manual_seed(a.seed)
    src = model_source(a.model).model_copy(update={"dtype": a.dtype})
    t0 = time.perf_counter()
    model, tok = load_model(src, device)
    load_s = time.perf_counter() - t0
    info = {"model": a.model, "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
            "dtype": str(model.head_weight.dtype).replace("torch.", ""), "torch": torch.__version__,
            "load_s": load_s}
    graphs = not a.no_cuda_graphs
    if a.what == "rollout":
        prompts = chat_prompts(tok, gsm8k_questions(a.dataset, a.prompts))
        res = bench_rollout(model, tok, prompts, a.samples, a.max_new_tokens, a.temperature, a.sd, a.sd_depth,
                            graphs, a.compile, a.seed, a.top_k, a.sd_on_below, sd_costs_below=a.sd_costs_below)
        res.update(prompts=a.prompts, samples=a.samples, max_new_tokens=a.max_new_tokens,
                   temperature=a.temperature, top_k=a.top_k)
    else:
        prompts = chat_prompts(tok, gsm8k_questions(a.dataset, a.batch))
        res = bench_decode(model, tok, prompts, a.max_new_tokens, graphs, a.compile, top_k=a.top_k)
    res.update(info)
    sys.stdout.write(json.dumps(res, indent=None if a.json else 2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
