"""`tlt selfcheck`: prove on your own hardware that speculative decoding (SD) in the rollout engine is lossless.

    tlt selfcheck --model tiny --json                      # tiny random models, < 1 minute on 2 CPU cores
    tlt selfcheck --model smollm2-135m-instruct --json     # the real model (GPU recommended)
    tlt selfcheck --model /path/to/hf_dir_or.gguf --prompts 32

Two checks, printed as one JSON object (keys: sequences, identical_sequences, identical_token_fraction,
sampling_pvalue_min, negative_control_pvalue, passed, ...):
1. Greedy: SD (small-model chains of several lengths, top-k trees, the n-gram drafter) must emit exactly the tokens
   of plain greedy decoding, for every sequence, over random prompts and several batch shapes (slot counts: the
   continuous batcher mixes admission and retirement). A few are also checked against a naive full-recompute decoder.
   The first chain runs at every slot count, each other variant at one of them.
   identical_token_fraction = common-prefix tokens / reference tokens (1.0 unless a sequence diverges).
2. Sampling: the engine's first three emitted tokens (the first from prefill, the next two from one decode / SD
   step) are sampled many times for several temperature / top-p / top-k settings, and the empirical joint law of
   tokens 2-3 is compared with the exact one (enumerated from the target) by a chi-square test, for plain decoding,
   SD chains with sampled drafts and SD trees. A negative control (samples tested against a different temperature)
   must be rejected, which shows the test has power.
Real models load in fp32 by default (`--dtype`): what is checked is the algorithm, and in bf16 two forwards of the same
logits (the engine's kernels, the reference's torch forward) part at near-ties, so a top-k boundary moves and a
sampled pair the reference calls impossible fails the test without any SD involved.
passed: every sequence identical in fp32 (identical_token_fraction >= 0.95 in bf16/fp16, where batch shapes change
rounding), every sampling p-value >= 1e-4, the negative control's p-value < 1e-4, and no check skipped.
Progress: one line per check on stderr as it ends (its result, its seconds, the total, and the CUDA graphs it
captured). `--budget-s S` starts no new check after S seconds; the ones left are listed in `skipped_for_budget` (each
check is one engine run: bounded by --prompts, --max-new-tokens and --samples).
Where a GPU's seconds go: not into decoding (a few hundred tokens) but into first uses -- Triton compiles, CUDA graph
captures, and the fused kernels' launch-config tuning (every candidate config of every weight shape compiled and
timed). So one engine per batch shape serves every check of that shape (`SharedEngine`: its graphs are captured once,
not once per variant), and the kernels run on the configs already tuned on this GPU, seeded, or the default rule
unless `--tune` asks for tuning: the check compares SD with plain decoding on the same configs whichever they are.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from dataclasses import replace

import torch

from worker.tlt.config import BUILTIN_MODELS, ModelSource
from worker.tlt.decoding.sampling import processed_probs
from worker.tlt.kernels.settings import configure, current
from worker.tlt.model.args import preset
from worker.tlt.model.load import load_model, random_model
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import naive_greedy, perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, GenerationOutput, Request, RequestSampling
from worker.tlt.speculative.arm import Arm, chain_arm, tree_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.ngram import NGramProposer
from worker.tlt.speculative.proposers.protocol import Proposer
from worker.tlt.speculative.proposers.small_model import SmallModelProposer
from worker.tlt.speculative.verify.stat_tests import chi_square_pvalue

log = logging.getLogger(__name__)
P_MIN, NEG_MAX = 1e-4, 1e-4
# sequences the sampling check keeps resident: its samples run in waves of this many (continuous batching admits the
# next as rows finish), within the engine's largest batch bucket
SAMPLING_SLOTS = 512


class Progress:
    """One line per check on stderr as it finishes (stdout keeps the JSON report), and the time budget: once
    `budget_s` has passed since the start, the remaining checks are skipped and named in the report."""

    def __init__(self, budget_s: float | None = None, quiet: bool = False) -> None:
        self.t0 = time.perf_counter()
        self.budget_s, self.quiet = budget_s, quiet
        self.skipped: list[str] = []

    def over_budget(self, name: str) -> bool:
        """True (and `name` recorded as skipped) when the budget is spent; call before starting a check."""
        if self.budget_s is not None and time.perf_counter() - self.t0 > self.budget_s:
            self.skipped.append(name)
            return True
        return False

    def done(self, name: str, result: str, started: float) -> None:
        if not self.quiet:
            sys.stderr.write(f"selfcheck {name}: {result} ({time.perf_counter() - started:.1f} s, "
                             f"{time.perf_counter() - self.t0:.0f} s total)\n")
            sys.stderr.flush()


def _spec_variants() -> list[tuple[str, Arm]]:
    return [
        ("chain4", chain_arm("small", 4)),
        ("chain8", chain_arm("small", 8)),
        ("tree3x2", tree_arm("small", 3, 2, 8)),
        ("ngram5", chain_arm("ngram", 5)),
        ("ngram-tree", tree_arm("ngram", 4, 2, 10)),
    ]


def _greedy_plan(variants: list[tuple[str, Arm]], slot_counts: tuple[int, ...]) -> list[tuple[str, Arm, int]]:
    """The first variant at every slot count, each other at one slot count in turn (the largest first: fewest engine
    steps): every batch shape and every kind of draft is checked, in fewer runs than the full grid."""
    first, *rest = variants
    plan = [(*first, slots) for slots in slot_counts]
    return plan + [(*v, slot_counts[-1 - i % len(slot_counts)]) for i, v in enumerate(rest)]


class SharedEngine:
    """One engine for every check of one batch shape: sized at construction for the widest arm it will run (KV
    headroom) with every drafter, each check's controller passed to its generate() call (none: plain decoding), as a
    training job's engine serves its validation rollouts. Its CUDA graphs (prefill, decode, verify, drafts) are
    captured once per shape, not once per check: on a GPU the captures and their first-use kernel compiles, not the
    decoding, are what a check costs."""

    def __init__(self, target: Transformer, drafter: Transformer, eos: tuple[int, ...], cfg: EngineConfig,
                 arms: list[Arm]) -> None:
        widest = max(arms, key=lambda a: a.verify_tokens)
        proposers: dict[str, Proposer] = {"small": SmallModelProposer(drafter), "ngram": NGramProposer()}
        self.engine = Engine(target, eos_ids=eos, config=cfg, controller=AdaptiveSd.fixed(widest), proposers=proposers)

    def generate(self, reqs: list[Request], arm: Arm | None, seed: int | None = None) -> GenerationOutput:
        """SD with `arm` at every step (None: plain decoding); `seed` restarts the sampling stream."""
        if arm is not None and arm.verify_tokens > self.engine.max_nodes:
            raise ValueError(f"arm {arm.name} verifies {arm.verify_tokens} tokens; the engine has room for "
                             f"{self.engine.max_nodes}")
        if seed is not None:
            self.engine.gen.manual_seed(seed)
        if arm is None:
            return self.engine.generate(reqs, plain=True)
        return self.engine.generate(reqs, controller=AdaptiveSd.fixed(arm))

    def graphs_since(self, before: tuple[int, float]) -> str:
        """How much of a check's time went to CUDA graph captures (on a fresh GPU, mostly first-use kernel compiles
        and launch-config tuning)."""
        n, seconds = self.engine.graph_set.captured()
        n, seconds = n - before[0], seconds - before[1]
        return f"; {n} graphs captured in {seconds:.1f} s" if n else ""


def greedy_check(target: Transformer, drafter: Transformer, prompts: list[list[int]], max_new: int,
                 eos: tuple[int, ...], slot_counts: tuple[int, ...], naive: int = 4,
                 progress: Progress | None = None) -> dict:
    """SD vs plain greedy for each (variant, slot count) of `_greedy_plan`; the plain run (at one slot per prompt) is
    checked against naive recompute. One engine per slot count serves every check at that count."""
    progress = progress or Progress(quiet=True)
    t = time.perf_counter()
    max_len = max(len(p) for p in prompts) + max_new + 1
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=max_new)) for p in prompts]
    variants = _spec_variants()
    arms = [arm for _, arm in variants]
    engines: dict[int, SharedEngine] = {}

    def engine_for(slots: int) -> SharedEngine:
        if slots not in engines:
            engines[slots] = SharedEngine(target, drafter, eos, EngineConfig(max_len=max_len, max_slots=slots), arms)
        return engines[slots]

    plain = engine_for(len(prompts))
    before = plain.engine.graph_set.captured()
    ref = [s.tokens for s in plain.generate(reqs, None).sequences]
    naive_ok = all(naive_greedy(target, prompts[i], max_new, eos) == ref[i] for i in range(min(naive, len(prompts))))
    progress.done("greedy plain vs naive recompute", ("match" if naive_ok else "MISMATCH") + plain.graphs_since(before),
                  t)
    seqs = identical = ref_tokens = common = 0
    per_variant: dict[str, float] = {}
    for name, arm, slots in _greedy_plan(variants, slot_counts):
        key = f"{name}/slots{slots}"
        if progress.over_budget(f"greedy {key}"):
            continue
        t = time.perf_counter()
        shared = engine_for(slots)
        before = shared.engine.graph_set.captured()
        out = shared.generate(reqs, arm)
        same = 0
        for got, want in zip((s.tokens for s in out.sequences), ref, strict=True):
            seqs += 1
            same += got == want
            ref_tokens += len(want)
            k = 0
            while k < min(len(got), len(want)) and got[k] == want[k]:
                k += 1
            common += k
        identical += same
        stats = shared.engine.accept_stats
        per_variant[key] = stats.mean_accept_len if stats.steps else 0.0
        progress.done(f"greedy {key}", f"{same}/{len(ref)} identical, accept length {per_variant[key]:.2f}"
                      + shared.graphs_since(before), t)
    return {
        "sequences": seqs,
        "identical_sequences": identical,
        "identical_token_fraction": common / max(ref_tokens, 1),
        "naive_reference_matches": naive_ok,
        "mean_accept_len": per_variant,
    }


@torch.no_grad()
def exact_pair_law(model: Transformer, prompt: list[int], temp: float, top_p: float,
                   top_k: int) -> dict[tuple[int, int], float]:
    """Exact law of (token 2, token 3) of a continuation, marginalised over token 1 (support enumerated)."""
    dev = model.head_weight.device

    def probs(seqs: list[list[int]]) -> torch.Tensor:  # [N, V]
        logits = model(torch.tensor(seqs, device=dev))[:, -1]
        return processed_probs(logits, temp, top_p, top_k).double().cpu()

    p1 = probs([prompt])[0]
    s1 = torch.nonzero(p1).flatten().tolist()
    p2 = probs([prompt + [a] for a in s1])
    pairs = [(a, b, float(p1[a] * p2[i, b])) for i, a in enumerate(s1) for b in torch.nonzero(p2[i]).flatten().tolist()]
    law: dict[tuple[int, int], float] = {}
    for j in range(0, len(pairs), 256):
        chunk = pairs[j : j + 256]
        p3 = probs([prompt + [a, b] for a, b, _ in chunk])
        for (_, b, w), row in zip(chunk, p3, strict=True):
            for c in torch.nonzero(row).flatten().tolist():
                law[(b, c)] = law.get((b, c), 0.0) + w * float(row[c])
    return law


def _pvalue(samples: list[tuple[int, int]], law: dict[tuple[int, int], float]) -> float:
    counts = Counter(samples)
    if any(k not in law for k in counts):
        return 0.0  # an impossible pair was emitted
    keys = list(law)
    return chi_square_pvalue(torch.tensor([counts.get(k, 0) for k in keys]), torch.tensor([law[k] for k in keys]))


def sampling_check(target: Transformer, drafter: Transformer, prompt: list[int], samples: int,
                   settings: list[tuple[float, float, int]], slots: int, progress: Progress | None = None) -> dict:
    progress = progress or Progress(quiet=True)
    variants: list[tuple[str, Arm | None]] = [
        ("plain", None), ("chain2", chain_arm("small", 2)), ("tree2x2", tree_arm("small", 2, 2, 5))]
    sd_arms = [arm for _, arm in variants if arm is not None]
    pvals: dict[str, float] = {}
    negative = 1.0
    for si, (temp, top_p, top_k) in enumerate(settings):
        if si > 0 and progress.over_budget(f"sampling T{temp}/p{top_p}/k{top_k}"):
            continue  # the first setting always runs: it carries the negative control
        law = exact_pair_law(target, prompt, temp, top_p, top_k)
        params = RequestSampling(temperature=temp, top_p=top_p, top_k=top_k, max_new_tokens=3, eos_ids=(), n=samples)
        # one engine per setting: its variants share the batch shapes (a setting's sampling filters are its own)
        shared = SharedEngine(target, drafter, (), EngineConfig(max_len=len(prompt) + 4, max_slots=min(slots, samples)),
                              sd_arms)
        for vi, (name, arm) in enumerate(variants):
            key = f"{name}/T{temp}/p{top_p}/k{top_k}"
            if vi > 0 and progress.over_budget(f"sampling {key}"):
                continue
            t = time.perf_counter()
            before = shared.engine.graph_set.captured()
            out = shared.generate([Request(prompt, params)], arm, seed=1000 * si + vi)
            pairs = [(s.tokens[1], s.tokens[2]) for s in out.sequences]
            pvals[key] = _pvalue(pairs, law)
            if si == 0 and vi == 0:  # negative control: the same samples against another temperature's law
                wrong = exact_pair_law(target, prompt, temp * 1.25, top_p, top_k)
                negative = _pvalue(pairs, wrong)
                progress.done("sampling negative control", f"p = {negative:.2g} (must be < {NEG_MAX:g})", t)
            progress.done(f"sampling {key}", f"p = {pvals[key]:.3g} over {samples} samples"
                          + shared.graphs_since(before), t)
    return {"sampling_pvalues": pvals, "sampling_pvalue_min": min(pvals.values()), "negative_control_pvalue": negative}


def run(model_name: str, prompts_n: int, max_new: int, samples: int, device: str, seed: int,
        progress: Progress | None = None, dtype: torch.dtype | None = torch.float32, tune: bool = False) -> dict:
    """The whole check. `tune`: time the fused kernels' launch-config candidates at each weight shape's first use, as
    a training job does; off, the kernels launch with the configs already tuned on this GPU (on disk) or seeded, else
    the default rule. Which configs run does not change what is checked (SD against plain decoding, both on the same
    configs: every config computes a row the same whatever the batch), and tuning compiles and times every candidate
    of every shape, most of a check's time on a fresh GPU."""
    previous = configure(replace(current(), tune=tune))
    try:
        report = _run(model_name, prompts_n, max_new, samples, device, seed, progress, dtype)
    finally:
        configure(previous)
    report["kernel_configs"] = "tuned at first use" if tune else "cached, seeded or the default rule (no tuning)"
    return report


def _run(model_name: str, prompts_n: int, max_new: int, samples: int, device: str, seed: int,
         progress: Progress | None, dtype: torch.dtype | None) -> dict:
    t0 = time.perf_counter()
    progress = progress or Progress(quiet=True)
    if model_name == "tiny":
        target = tiny_target("tiny-llama")
        drafter = perturbed_copy(target, noise=0.15)
        eos: tuple[int, ...] = (257,)
        vocab = 256
        small = random_model(preset("tiny-qwen3", vocab_size=12, eos_token_ids=()), seed=seed, std=0.3)
        small_drafter = perturbed_copy(small, noise=0.5)
        s_prompt, settings = [1, 5, 7], [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.5, 1.0, 5)]
        slot_counts: tuple[int, ...] = (3, prompts_n)
    else:
        source = ModelSource(builtin=model_name) if model_name in BUILTIN_MODELS else (
            ModelSource(gguf=model_name) if model_name.endswith(".gguf") else ModelSource(hf_dir=model_name))
        target, tok = load_model(source, device, dtype=dtype)
        drafter = perturbed_copy(target, noise=0.05)
        eos, vocab = tok.eos_ids, min(tok.vocab_size, target.args.vocab_size)
        small, small_drafter = target, drafter
        s_prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Count to ten."}]))
        settings = [(1.0, 1.0, 8), (0.7, 0.9, 4)]  # top-k keeps the exact law enumerable on a large vocabulary
        slot_counts = (1, 8, prompts_n)
    progress.done(f"load {model_name}", f"{str(target.head_weight.dtype).replace('torch.', '')} on "
                  f"{target.head_weight.device}", t0)
    prompts = random_prompts(prompts_n, seed=seed, vocab=vocab)
    report: dict = {"model": model_name, "device": str(target.head_weight.device),
                    "dtype": str(target.head_weight.dtype).replace("torch.", "")}
    report.update(greedy_check(target, drafter, prompts, max_new, eos, slot_counts, progress=progress))
    report.update(sampling_check(small, small_drafter, s_prompt, samples, settings, slots=SAMPLING_SLOTS,
                                  progress=progress))
    fp32 = target.head_weight.dtype == torch.float32
    greedy_ok = (report["identical_sequences"] == report["sequences"] if fp32
                 else report["identical_token_fraction"] >= 0.95) and report["naive_reference_matches"]
    # checks skipped for the time budget are named; a run that skipped any has not shown everything, so it does not pass
    report["skipped_for_budget"] = progress.skipped
    report["passed"] = bool(greedy_ok and report["sampling_pvalue_min"] >= P_MIN
                            and report["negative_control_pvalue"] < NEG_MAX and not progress.skipped)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tlt selfcheck", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | a builtin model (e.g. smollm2-135m-instruct@qwen2.5-7b) | PATH (HF dir or .gguf)")
    ap.add_argument("--prompts", type=int, default=12, help="random prompts for the greedy check")
    ap.add_argument("--max-new-tokens", type=int, default=20)
    ap.add_argument("--samples", type=int, default=4000, help="samples per sampling setting and variant")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"),
                    help="the real model's dtype (auto: the source's); exactness is checked in float32")
    ap.add_argument("--json", action="store_true", help="print the JSON summary on one line")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting new checks after this many seconds (those left are listed as skipped, and "
                         "the run does not pass)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--tune", action="store_true",
                    help="tune the fused kernels' launch configs at first use, as training does (slower on a fresh "
                         "GPU; the check compares SD with plain decoding on whichever configs run)")
    a = ap.parse_args(argv)
    if a.budget_s is not None and a.budget_s <= 0:
        ap.error("--budget-s must be positive")
    if a.model == "tiny" and a.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes: one thread is much faster than contended threads
        a.device = "cpu"
    progress = Progress(a.budget_s, quiet=a.quiet)
    report = run(a.model, a.prompts, a.max_new_tokens, a.samples, "cpu" if a.model == "tiny" else a.device, a.seed,
                 progress=progress, dtype=None if a.dtype == "auto" else getattr(torch, a.dtype), tune=a.tune)
    text = json.dumps(report, indent=None if a.json else 2)
    sys.stdout.write(text + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
