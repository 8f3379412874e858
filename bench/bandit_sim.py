"""Compare the SD-arm bandits (BEG-MAB epsilon-greedy, sliding UCB1, Gaussian Thompson) on the simulated cost model.

For each scenario (drafter acceptance per kind, possibly changing mid-run) every bandit plays `--rounds` steps in
each bucket (buckets interleaved, 25 steps at a time), the active batch drawn uniformly from the bucket's range; the oracle knows the expected reward
of every arm at every batch size (worker/tlt/speculative/control/sim.py). Printed per (scenario, bandit), averaged over seeds:
regret (1 - expected tokens/s of chosen arms / oracle's, all rounds), realised tokens/s relative to always "none"
(SD off), and the fraction of the last 20% of rounds on the oracle's arm.

A second table runs whole simulated rollouts (`--rollouts` of 512 sequences, log-normal lengths <= 1024; the bandit
keeps its state from one rollout to the next, as across RL steps; in the changing scenarios the acceptance changes
at the middle rollout) with the SD switch (on below 32, patience 3): rollout time, tail tokens/s and per-bucket
tokens/s relative to SD off, for each bandit and for the per-step oracle.

A third table checks the adaptive engine's rule "never slower than SD off" where the H200 broke it: one GPU's buckets
(arms.ONE_GPU_BUCKETS), SD on below 160, an SD step paying 30 ms extra (eager verify) or nothing (graphed verify),
n-gram drafts from useless to good; Thompson sampling with the conservative loss budget (BanditConfig.loss_budget,
3%) and without it: rollout time and the worst bucket's time relative to SD off.

Run: `python -m bench.bandit_sim [--rounds 3000] [--seeds 5] [--rollouts 8] [--jobs 2]
[--out bench/results/bandit_sim.md]` (CPU; a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from worker.tlt.speculative.arm import NO_SD
from worker.tlt.speculative.control.arm_buckets import ONE_GPU_BUCKETS, TLT_BUCKETS, arms_table
from worker.tlt.speculative.control.bandit import BANDITS, BanditConfig, BanditKind, WindowBandit, make_bandit
from worker.tlt.speculative.control.sd_metrics import RolloutSdMetrics
from worker.tlt.speculative.control.sim import (
    SimCostModel,
    SimEnv,
    SimTrace,
    response_lengths,
    run_bucket,
    simulate_rollout,
)
from worker.tlt.speculative.control.switch import SwitchConfig

# Batch range per bucket while SD is on (the switch turns SD off at >= 48 active with on_below 32).
BATCH_RANGES = {0: (1, 1), 1: (2, 4), 2: (5, 20), 3: (21, 47)}


@dataclass(frozen=True)
class Scenario:
    name: str
    alphas: dict[str, float]  # per-position acceptance of each available drafter at the start
    events: dict[float, dict[str, float]] = field(default_factory=dict)  # fraction of the run -> new alphas


SCENARIOS = (
    Scenario("ngram only (a=0.5)", {"ngram": 0.5}),
    Scenario("ngram 0.5 + eagle 0.8", {"ngram": 0.5, "eagle": 0.8}),
    Scenario("useless drafts (a=0)", {"ngram": 0.0, "eagle": 0.0}),
    Scenario("eagle improves 0.1->0.8", {"ngram": 0.4, "eagle": 0.1}, {0.5: {"eagle": 0.8}}),
    Scenario("eagle degrades 0.8->0.1", {"ngram": 0.4, "eagle": 0.8}, {0.5: {"eagle": 0.1}}),
)


def run(scenario: Scenario, kind: BanditKind, rounds: int, seed: int, config: BanditConfig,
        chunk: int = 25) -> dict[str, float]:
    """All buckets played interleaved, `chunk` rounds each in turn (as a rollout passes through them), so an
    acceptance change (scenario event) hits every bucket at the same time."""
    table = arms_table(list(scenario.alphas))  # type: ignore[arg-type]
    bandit = make_bandit(table, replace(config, kind=kind), seed=seed)
    rng = random.Random(1000 + seed)
    envs = {b: SimEnv(dict(scenario.alphas), seed=seed * 10 + b) for b in table}
    batches = {b: [rng.randint(*BATCH_RANGES[b]) for _ in range(rounds)] for b in table}
    traces = {b: SimTrace() for b in table}
    events = {int(f * rounds): a for f, a in scenario.events.items()}
    for start in range(0, rounds, chunk):
        for at, alphas in events.items():
            if start <= at < start + chunk:
                for env in envs.values():
                    env.alphas.update(alphas)
        for b, arms in table.items():
            t = run_bucket(bandit, envs[b], b, arms, batches[b][start:start + chunk])
            tr = traces[b]
            tr.chosen += t.chosen
            tr.best += t.best
            tr.reward += t.reward
            tr.oracle_reward += t.oracle_reward
            tr.tokens += t.tokens
            tr.seconds += t.seconds
    reward = sum(sum(t.reward) for t in traces.values())
    oracle = sum(sum(t.oracle_reward) for t in traces.values())
    # SD-off reference ("none"'s reward does not depend on the acceptance).
    none_reward = sum(envs[b].expected_reward(NO_SD, n) for b in table for n in batches[b])
    return {"regret": 1.0 - reward / oracle, "vs_off": reward / none_reward, "oracle_vs_off": oracle / none_reward,
            "best_last": statistics.fmean(t.fraction_best(rounds // 5) for t in traces.values()),
            "tokens_per_s": sum(t.tokens for t in traces.values()) / sum(t.seconds for t in traces.values())}


def run_rollouts(scenario: Scenario, policy: str, rollouts: int, seed: int,
                 config: BanditConfig) -> list[RolloutSdMetrics]:
    """Metrics of `rollouts` consecutive rollouts under one policy ("off", "oracle" or a bandit kind)."""
    table = arms_table(list(scenario.alphas))  # type: ignore[arg-type]
    pol: WindowBandit | str = policy
    if policy not in ("off", "oracle"):
        pol = make_bandit(table, replace(config, kind=policy), seed=seed)  # type: ignore[arg-type]
    env = SimEnv(dict(scenario.alphas), seed=seed)
    out = []
    for r in range(rollouts):
        for frac, alphas in scenario.events.items():
            if r == int(frac * rollouts):
                env.alphas.update(alphas)
        out.append(simulate_rollout(env, response_lengths(512, seed=seed * 100 + r), table, pol))
    return out


def _rollout_cell(job: tuple[Scenario, str, int, int, BanditConfig]) -> dict[str, float]:
    sc, policy, rollouts, seed, config = job
    ms = run_rollouts(sc, policy, rollouts, seed, config)
    out = {"seconds": sum(m.full.seconds + m.tail.seconds for m in ms),
           "tail_tokens": sum(m.tail.tokens for m in ms), "tail_seconds": sum(m.tail.seconds for m in ms)}
    for m in ms:
        for row in m.per_bucket():
            out[f"tok/{row['bucket']}"] = out.get(f"tok/{row['bucket']}", 0.0) + row["tokens"]
            out[f"sec/{row['bucket']}"] = out.get(f"sec/{row['bucket']}", 0.0) + row["seconds"]
    return out


def rollout_table(args: argparse.Namespace, config: BanditConfig, pool: multiprocessing.pool.Pool) -> list[str]:
    policies = ["off", "oracle", *BANDITS]
    jobs = [(sc, p, args.rollouts, seed, config) for sc in SCENARIOS for p in policies for seed in range(args.seeds)]
    results = iter(pool.map(_rollout_cell, jobs, chunksize=1))
    labels = [TLT_BUCKETS.label(b) for b in range(TLT_BUCKETS.num_buckets)]
    lines = ["", f"Simulated rollouts: {args.rollouts} consecutive rollouts x 512 sequences, {args.seeds} seeds, "
             "switch on below 32 (patience 3); ratios to SD off (same lengths, same seeds)", "",
             "| scenario | policy | rollout time vs off | tail tok/s vs off | " + " | ".join(
                 f"bucket {lb} tok/s vs off" for lb in labels) + " |", "|---|---|---|---|" + "---|" * len(labels)]
    for sc in SCENARIOS:
        rows = {p: [next(results) for _ in range(args.seeds)] for p in policies}
        off = rows["off"]
        for p in policies[1:]:
            rs = rows[p]
            time_ratio = statistics.fmean(r["seconds"] / o["seconds"] for r, o in zip(rs, off, strict=True))
            tail = statistics.fmean((r["tail_tokens"] / r["tail_seconds"]) / (o["tail_tokens"] / o["tail_seconds"])
                                    for r, o in zip(rs, off, strict=True))
            cells = []
            for lb in labels:
                pairs = [(r, o) for r, o in zip(rs, off, strict=True) if r.get(f"sec/{lb}") and o.get(f"sec/{lb}")]
                cells.append(f"{statistics.fmean((r[f'tok/{lb}'] / r[f'sec/{lb}']) / (o[f'tok/{lb}'] / o[f'sec/{lb}']) for r, o in pairs):.2f}x"
                             if pairs else "-")
            lines.append(f"| {sc.name} | {p} | {time_ratio:.3f}x | {tail:.2f}x | " + " | ".join(cells) + " |")
    return lines


def _never_slower_cell(job: tuple[float, float, str, int, int]) -> dict[str, float]:
    """Seconds and tokens, in total and per bucket, of `rollouts` rollouts: policy "off", "budget" or "free"."""
    alpha, overhead, policy, rollouts, seed = job
    table = arms_table(["ngram"], ONE_GPU_BUCKETS)
    pol: WindowBandit | str = "off" if policy == "off" else make_bandit(
        table, BanditConfig(loss_budget=0.03 if policy == "budget" else None), seed=seed)
    switch = SwitchConfig(mode="off") if policy == "off" else SwitchConfig(on_below=160, patience=3)
    env = SimEnv({"ngram": alpha}, model=SimCostModel(sd_overhead_s=overhead), seed=seed)
    out: dict[str, float] = {}
    for r in range(rollouts):
        m = simulate_rollout(env, response_lengths(512, seed=seed * 100 + r), table, pol, switch, ONE_GPU_BUCKETS)
        out["total"] = out.get("total", 0.0) + m.full.seconds + m.tail.seconds
        for row in m.per_bucket():
            out[f"sec/{row['bucket']}"] = out.get(f"sec/{row['bucket']}", 0.0) + row["seconds"]
            out[f"tok/{row['bucket']}"] = out.get(f"tok/{row['bucket']}", 0.0) + row["tokens"]
    return out


def never_slower_table(args: argparse.Namespace, pool: multiprocessing.pool.Pool) -> list[str]:
    cases = [(a, o) for o in (30e-3, 0.0) for a in (0.0, 0.3, 0.6)]
    policies = ("off", "budget", "free")
    jobs = [(a, o, p, args.rollouts, seed) for a, o in cases for p in policies for seed in range(args.seeds)]
    results = iter(pool.map(_never_slower_cell, jobs, chunksize=1))
    lines = ["", f"Never slower than SD off: {args.rollouts} rollouts x 512 sequences, {args.seeds} seeds, one GPU's "
             "buckets, SD on below 160 (patience 3), Thompson; rollout time relative to SD off, and the worst "
             "bucket's slowdown (SD-off tokens/s / adaptive tokens/s in that bucket; > 1 = slower)", "",
             "| n-gram acceptance | SD step extra cost | loss budget 3%: time | worst bucket | no budget: time "
             "| worst bucket |", "|---|---|---|---|---|---|"]
    for a, o in cases:
        rows = {p: [next(results) for _ in range(args.seeds)] for p in policies}
        cells = []
        for p in ("budget", "free"):
            total = statistics.fmean(r["total"] / f["total"] for r, f in zip(rows[p], rows["off"], strict=True))
            buckets = [k[4:] for k in rows["off"][0] if k.startswith("sec/")]
            worst = max((sum(f[f"tok/{b}"] for f in rows["off"]) / sum(f[f"sec/{b}"] for f in rows["off"]))
                        / (sum(r.get(f"tok/{b}", 0.0) for r in rows[p]) / sum(r.get(f"sec/{b}", 1e-12) for r in rows[p]))
                        for b in buckets)
            cells += [f"{total:.3f}x", f"{worst:.3f}x"]
        lines.append(f"| {a:.1f} | {o * 1e3:.0f} ms | " + " | ".join(cells) + " |")
    return lines


def _cell(job: tuple[Scenario, BanditKind, bool, int, int, BanditConfig]) -> dict[str, float]:
    sc, kind, per_seq, rounds, seed, config = job
    return run(sc, kind, rounds, seed, replace(config, per_sequence=per_seq))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3000, help="steps per bucket")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--window", type=int, default=BanditConfig.window)
    ap.add_argument("--max-age", type=int, default=BanditConfig.max_age)
    ap.add_argument("--ucb-c", type=float, default=BanditConfig.ucb_c)
    ap.add_argument("--epsilon", type=float, default=BanditConfig.epsilon)
    ap.add_argument("--reward", choices=["both", "per_seq", "raw"], default="both",
                    help="reward per active sequence, raw tokens/s of the step, or both as separate rows")
    ap.add_argument("--rollouts", type=int, default=8, help="consecutive simulated rollouts; 0 = skip that table")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = ap.parse_args()
    config = BanditConfig(window=args.window, max_age=args.max_age, ucb_c=args.ucb_c, epsilon=args.epsilon)
    rewards = {"both": (False, True), "per_seq": (True,), "raw": (False,)}[args.reward]
    variants: list[tuple[BanditKind, bool]] = [(kind, ps) for kind in BANDITS for ps in rewards]
    jobs = [(sc, kind, ps, args.rounds, seed, config) for sc in SCENARIOS for kind, ps in variants
            for seed in range(args.seeds)]
    with multiprocessing.Pool(args.jobs) as pool:
        results = iter(pool.map(_cell, jobs, chunksize=1))
        extra = rollout_table(args, config, pool) + never_slower_table(args, pool) if args.rollouts else []
    lines = [
        f"Bandit comparison on the simulated cost model: {args.rounds} rounds per bucket x 4 buckets "
        f"({', '.join(TLT_BUCKETS.label(b) for b in range(4))}), {args.seeds} seeds; window={config.window} "
        f"max_age={config.max_age} min_pulls={config.min_pulls} epsilon={config.epsilon} ucb_c={config.ucb_c} "
        f"prior_std={config.prior_std}",
        "",
        "reward: 'raw' = tokens/s of the step (TLT); 'per seq' = tokens/s per active sequence, with windows borrowed "
        f"from the nearest bucket during a bucket's first {config.share_rounds} rounds (BanditConfig.per_sequence, "
        "share_rounds)",
        "",
        "| scenario | bandit | reward | regret vs oracle | reward vs SD off | oracle vs SD off | oracle arm, last 20% |",
        "|---|---|---|---|---|---|---|",
    ]
    totals: dict[str, list[float]] = {}
    for sc in SCENARIOS:
        for kind, ps in variants:
            rs = [next(results) for _ in range(args.seeds)]
            m = {k: statistics.fmean(r[k] for r in rs) for k in rs[0]}
            label = "per seq" if ps else "raw"
            totals.setdefault(f"{kind} ({label})", []).append(m["regret"])
            lines.append(f"| {sc.name} | {kind} | {label} | {m['regret']:.1%} | {m['vs_off']:.2f}x "
                         f"| {m['oracle_vs_off']:.2f}x | {m['best_last']:.0%} |")
    ranked = sorted(totals.items(), key=lambda kv: statistics.fmean(kv[1]))
    lines += ["", "Mean regret over scenarios: " + ", ".join(f"{k} {statistics.fmean(v):.2%}" for k, v in ranked)]
    lines += extra
    text = "\n".join(lines)
    print(text)  # this is a CLI script: the table is its output
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
