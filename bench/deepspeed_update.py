"""The GRPO policy update alone, torch AdamW vs DeepSpeed (ZeRO stage, optimizer offload), at a model shape: seconds
per update of one 8 x 8 step, peak GPU and host memory, and the memory plan's arithmetic (rl/update_plan.py).

    python bench/deepspeed_update.py --model smollm2-135m --engine torch --json-out r.jsonl      # one case: a line
    python bench/deepspeed_update.py --model shape:llama3.2-3b --engine deepspeed --json-out r.jsonl
    python bench/deepspeed_update.py --model shape:qwen2.5-7b --engine deepspeed --zero-stage 3 --offload on \
        --offload-ratio 0.45 --checkpointing --steps 2 --json-out r.jsonl      # ZeRO-3, 45% of the state on the host
    python bench/deepspeed_update.py --table r.jsonl --out bench/results/deepspeed_update_h200.md  # the table

Each case runs in its own process (peak host memory is the process's). Weights are random bf16 at the named shape
(normal(0, 0.02), unit norms; model/args.py `shape(name)` or the SmolLM2-135M preset), trained through fp32 master
weights. The batch has the shape of a real 8 x 8 SmolLM2 GSM8K step at <= 1024 new tokens (bench/results/
train_update_profile_h200.md: mean 558, 38% clipped): 64 sequences of a 120-token prompt, 24 responses of 1024
tokens and 40 of 100-490 (mean 571). Rewards alternate so every group has advantages. The first update (allocation,
JIT builds) is reported apart; s/step is the mean of the following `--steps`. Progress (engine built, each update)
goes to stderr as it happens, so a case cut short by a time limit still leaves its figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from worker.tlt.config import JobSpec
from worker.tlt.model.args import PRESETS, shape
from worker.tlt.model.transformer import Transformer
from worker.tlt.rl.batch import UpdateSeq
from worker.tlt.rl.trainer import GRPOTrainer
from worker.tlt.rl.update_plan import count_params
from worker.tlt.rl.updater import build_updater


def fast_random_model(name: str, device: torch.device) -> Transformer:
    """Random bf16 weights drawn on the device (a 7B model in seconds, no host copy)."""
    args = shape(name[len("shape:"):]) if name.startswith("shape:") else PRESETS[name]
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device).to(torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.init_rope(device)
    return model.eval()


def batch(vocab: int) -> list[UpdateSeq]:
    g = torch.Generator().manual_seed(0)
    lengths = [1024] * 24 + [100 + 10 * i for i in range(40)]
    order = torch.randperm(64, generator=g).tolist()
    return [UpdateSeq(torch.randint(3, vocab, (120,), generator=g).tolist(),
                      torch.randint(3, vocab, (lengths[j],), generator=g).tolist(), 1.0 if i % 2 else -1.0, None)
            for i, j in enumerate(order)]


def run_case(a: argparse.Namespace) -> dict:
    device = torch.device("cuda", 0)
    res: dict = {"update_engine": a.engine}
    if a.zero_stage is not None:
        res["zero_stage"] = a.zero_stage
    if a.offload is not None:
        res["offload_optimizer"] = a.offload == "on"
    if a.offload_ratio is not None:
        res["offload_ratio"] = a.offload_ratio
    spec = JobSpec.model_validate({
        "name": "ds-bench", "resources": {"gpus": 1, **res}, "max_steps": 100,
        "algorithm": {"num_generations": 8, "prompts_per_step": 8, "max_completion_length": 1024,
                      "learning_rate": 1e-6, "gradient_checkpointing": a.checkpointing},
        "rollout": {"release_kv_for_update": True},  # the KV cache is freed for the update (as a real step)
    })
    model = fast_random_model(a.model, device)
    seqs = batch(model.args.vocab_size)
    rollout = SimpleNamespace(generator=torch.Generator(), on_weights_updated=lambda: None)
    tok = SimpleNamespace(pad_id=0, eos_ids=(1,))
    t0 = time.perf_counter()
    trainer = GRPOTrainer(spec, model, tok, rollout, [None], [], device=device,  # type: ignore[arg-type,list-item]
                          updater=build_updater(spec, model, device))
    init_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    progress(f"engine built in {init_s:.1f} s: {trainer.plan.summary()}", device)
    times, metrics = [], {}
    for i in range(a.steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = trainer.update(seqs)
        trainer.sync_weights()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        progress(f"update {i} in {times[-1]:.2f} s, grad norm {metrics.get('actor/grad_norm')}", device)
    trainer.close()
    plan = trainer.plan
    return {
        "model": a.model, "params_b": count_params(model.args) / 1e9, "engine": plan.engine,
        "zero_stage": plan.zero_stage, "offload": plan.offload_optimizer, "offload_ratio": plan.offload_ratio,
        "pin_host": plan.pin_host, "checkpointing": a.checkpointing,
        "init_s": init_s, "first_s": times[0], "step_s": sum(times[1:]) / max(1, len(times) - 1),
        "steps": times[1:], "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / 1e9,
        "peak_host_gb": peak_host_gb(),
        "tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in seqs),
        "grad_norm": metrics.get("actor/grad_norm"), "plan": plan.lines(),
        "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
    }


def peak_host_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def progress(what: str, device: torch.device) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {what}; peak GPU {torch.cuda.max_memory_allocated(device) / 1e9:.1f}"
                     f" GB, peak host {peak_host_gb():.1f} GB\n")
    sys.stderr.flush()


def table(rows: list[dict]) -> str:
    out = [f"GRPO policy update alone (8 x 8 step, {rows[0]['tokens']:,} tokens, <= 1024 new) — {rows[0]['gpu']}, "
           f"torch {rows[0]['torch']}; random bf16 weights at each shape, fp32 master weights", "",
           "| model | params | update | grad ckpt | s/step | first update s | init s | peak GPU GB | peak host GB |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        how = "torch AdamW" if r["engine"] == "torch" else f"DeepSpeed ZeRO-{r['zero_stage']}"
        if r["offload"]:
            ratio = r.get("offload_ratio", 1.0)
            how += " + CPU Adam offload" + (f" of {ratio:.0%} of the state" if ratio < 1 else "")
            how += "" if r.get("pin_host", True) else " (pageable)"
        out.append(f"| {r['model']} | {r['params_b']:.2f} B | {how} | {'on' if r['checkpointing'] else 'off'} | "
                   f"{r['step_s']:.2f} | {r['first_s']:.2f} | {r['init_s']:.1f} | {r['peak_gpu_gb']:.1f} | "
                   f"{r['peak_host_gb']:.1f} |")
    out += ["", "Memory plan of each case (rl/update_plan.py estimate, per rank):", ""]
    for r in rows:
        off = f" offload {r.get('offload_ratio', 1.0):g}" if r["offload"] else ""
        out.append(f"- {r['model']}, {r['engine']} ZeRO-{r['zero_stage']}{off}: "
                   + "; ".join(r["plan"]))
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a preset name or shape:NAME (model/args.py)")
    ap.add_argument("--engine", default="deepspeed", choices=["torch", "deepspeed", "auto"])
    ap.add_argument("--zero-stage", type=int, default=None)
    ap.add_argument("--offload", choices=["on", "off"], default=None)
    ap.add_argument("--offload-ratio", type=float, default=None,
                    help="resources.offload_ratio: the optimizer state's share on the host (< 1: ZeRO-3)")
    ap.add_argument("--checkpointing", action="store_true", help="algorithm.gradient_checkpointing")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json-out", default=None, help="append the case's result as a JSON line")
    ap.add_argument("--table", default=None, help="render this JSONL file as the markdown table instead")
    ap.add_argument("--out", default=None, help="markdown output of --table")
    a = ap.parse_args()
    if a.table:
        text = table([json.loads(line) for line in Path(a.table).read_text().splitlines() if line.strip()])
        sys.stdout.write(text)
        if a.out:
            Path(a.out).write_text(text)
        return 0
    row = run_case(a)
    sys.stdout.write(json.dumps(row) + "\n")
    if a.json_out:
        with open(a.json_out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
