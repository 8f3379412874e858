"""Rollout-level speculative-decoding metrics: what the adaptive engine did, step by step, summed per rollout.

The engine calls `RolloutSdMetrics.observe_step(...)` once per decode step (host-side numbers it already has) and
hands `summary()` to the Reporter at the end of the rollout. Names (worker/tlt/metric_catalog.py):

- `sd/on_fraction`: decode steps with the SD switch on / all decode steps;
- `sd/spec_step_fraction`: decode steps that drafted and verified (verify width > 1) / all decode steps: where SD
  really ran (with the switch on, the bandit may still pick plain decoding);
- `sd/accept_len`: mean tokens emitted per sequence per drafting step, accepted drafts + the bonus/recovered token
  (EAGLE's tau; 1.0 means no draft was ever accepted), before EOS / length truncation;
- `sd/accept_rate_pos_<k>` (k = 1, 2, ...): sequences whose k-th draft token was accepted / sequences that had a
  k-th draft token (so a drafter that proposed nothing at k does not count against position k);
- `sd/verify_tokens`: mean verify width per sequence (root included) on drafting steps;
- `sd/arm/<name>`: switch-on steps that ran arm <name> ("none" = the bandit chose plain decoding);
- `perf/tokens_per_s_full` / `perf/tokens_per_s_tail`: emitted tokens / wall seconds over steps with
  active >= on_below (full batch) and active < on_below (the tail);
- `perf/seq_tokens_per_s_tail_sd` / `perf/seq_tokens_per_s_tail_plain`: over the tail's steps that drafted and
  verified / that decoded plainly, tokens / sum of (active x seconds): one sequence's speed with and without SD in
  the same rollout (their ratio is the tail speed-up the dashboard shows);
- `perf/tail_s` / `perf/tail_sd_s`: wall seconds of the tail's decode steps, all of them / those that drafted and
  verified (the time-saved estimate of worker/tlt/sd_savings.py prices the latter's tokens at the plain rate);
- `perf/tokens_per_s_bucket/<label>`: the same per batch-size bucket ("1", "2-4", "5-20", "ge21");
- with the cost switch (`costs`): `sd/gain/<label>`, `sd/pays/<label>`, `sd/step_s_plain/<label>` and
  `sd/step_s_sd/<label>` (speculative/control/step_costs.py `StepCosts.summary`), the measured costs it decided by;
- `perf/seq_tokens_per_s_bucket/<label>`: per bucket, tokens / sum over steps of (active x seconds): the rate of one
  sequence. Two runs (SD off, adaptive) that spend their steps in a bucket at different batch sizes compare fairly
  on it; tokens/s mixes in how full the bucket's batches happened to be (a 17-32 bucket at 22 vs 19 rows on average
  reads 13% apart at the same step time).

A metric with nothing to average over (no tail steps, no drafting) is left out rather than reported as 0.

Run the tests: `python -m pytest tests/adaptive/test_adaptive_metrics.py -q`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.tlt import metric_catalog as mc
from worker.tlt.speculative.control.arm_buckets import TLT_BUCKETS, BucketScheme
from worker.tlt.speculative.control.step_costs import StepCosts
from worker.tlt.speculative.control.switch import in_tail


def per_position_counts(accepted: Sequence[int], drafted: Sequence[int]) -> tuple[list[int], list[int]]:
    """From per-sequence accepted and drafted lengths of one step, the per-position counts `observe_step` takes:
    (sequences with position k accepted, sequences with a draft at position k), k = 1..max(drafted)."""
    if len(accepted) != len(drafted) or any(a > d or a < 0 for a, d in zip(accepted, drafted, strict=True)):
        raise ValueError("need one accepted and one drafted length per sequence, 0 <= accepted <= drafted")
    depth = max(drafted, default=0)
    acc = [sum(a >= k for a in accepted) for k in range(1, depth + 1)]
    dr = [sum(d >= k for d in drafted) for k in range(1, depth + 1)]
    return acc, dr


@dataclass
class _Totals:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    seq_seconds: float = 0.0  # sum of active x seconds

    def add(self, tokens: int, seconds: float, active: int) -> None:
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds
        self.seq_seconds += active * seconds

    @property
    def seq_tokens_per_s(self) -> float | None:  # tokens per second of one sequence
        return self.tokens / self.seq_seconds if self.seq_seconds > 0 else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


@dataclass
class RolloutSdMetrics:
    on_below: int = 32  # steps with fewer active sequences are the tail (use the switch's on_below)
    scheme: BucketScheme = TLT_BUCKETS  # buckets of the per-bucket tokens/s
    costs: StepCosts | None = None  # the cost switch's measurements (kept across rollouts), reported with the rest
    steps: int = 0
    sd_on_steps: int = 0
    spec_steps: int = 0  # steps that drafted and verified
    draft_seq_steps: int = 0  # sum of active over drafting steps
    verify_tokens_total: int = 0  # sum of verify_tokens * active over drafting steps
    accepted_total: int = 0
    accepted_pos: list[int] = field(default_factory=list)  # [K] sequences with position k accepted
    drafted_pos: list[int] = field(default_factory=list)  # [K] sequences with a draft at position k
    arms: Counter[str] = field(default_factory=Counter)
    full: _Totals = field(default_factory=_Totals)
    tail: _Totals = field(default_factory=_Totals)
    tail_sd: _Totals = field(default_factory=_Totals)  # tail steps that drafted and verified
    tail_plain: _Totals = field(default_factory=_Totals)  # tail steps that decoded plainly
    buckets: dict[int, _Totals] = field(default_factory=dict)
    bucket_sd_steps: Counter[int] = field(default_factory=Counter)
    bucket_arms: dict[int, Counter[str]] = field(default_factory=dict)  # per bucket: switch-on steps per arm

    def observe_step(self, *, active: int, sd_on: bool, arm: str | None, verify_tokens: int, emitted: int,
                     seconds: float, accepted_per_pos: Sequence[int] = (),
                     drafted_per_pos: Sequence[int] | None = None, accepted: int | None = None) -> None:
        """One decode step.

        active: sequences in the batch; sd_on: the switch's state; arm: the arm run when on (None when off);
        verify_tokens: verify width per sequence, root included (1 = plain decoding); emitted: tokens appended across
        the batch (after truncation); seconds: step wall time; accepted_per_pos[k-1]: sequences whose k-th draft
        token was accepted; drafted_per_pos[k-1]: sequences that had a k-th draft token (default: all `active` for
        every position of accepted_per_pos). See `per_position_counts`. accepted: accepted draft tokens across the
        batch, for an engine that counts only the total (sd/accept_len then; the per-position rates need the lists).
        """
        if active < 1 or seconds <= 0 or emitted < 0 or verify_tokens < 1:
            raise ValueError(f"need active >= 1, seconds > 0, emitted >= 0, verify_tokens >= 1 (got {active}, "
                             f"{seconds}, {emitted}, {verify_tokens})")
        drafted = list(drafted_per_pos) if drafted_per_pos is not None else [active] * len(accepted_per_pos)
        if len(drafted) != len(accepted_per_pos) or any(
                not 0 <= a <= d <= active for a, d in zip(accepted_per_pos, drafted, strict=True)):
            raise ValueError("per-position counts must satisfy 0 <= accepted <= drafted <= active")
        total = sum(accepted_per_pos)
        if accepted is not None and (accepted < 0 or (accepted_per_pos and accepted != total)):
            raise ValueError(f"accepted={accepted} disagrees with sum(accepted_per_pos)={total}")
        self.steps += 1
        drafting = sd_on and verify_tokens > 1
        tail = in_tail(active, self.on_below)
        (self.tail if tail else self.full).add(emitted, seconds, active)
        if tail:
            (self.tail_sd if drafting else self.tail_plain).add(emitted, seconds, active)
        bucket = self.scheme.bucket(active)
        self.buckets.setdefault(bucket, _Totals()).add(emitted, seconds, active)
        if sd_on:
            self.sd_on_steps += 1
            self.bucket_sd_steps[bucket] += 1
            self.arms[arm or "none"] += 1
            self.bucket_arms.setdefault(bucket, Counter())[arm or "none"] += 1
        if drafting:
            self.spec_steps += 1
            self.draft_seq_steps += active
            self.verify_tokens_total += verify_tokens * active
            self.accepted_total += total if accepted is None else accepted
            for k, (a, d) in enumerate(zip(accepted_per_pos, drafted, strict=True)):
                if k == len(self.accepted_pos):
                    self.accepted_pos.append(0)
                    self.drafted_pos.append(0)
                self.accepted_pos[k] += a
                self.drafted_pos[k] += d

    def summary(self) -> dict[str, float]:
        """The metrics of everything observed so far (names above)."""
        out: dict[str, float] = {}
        if self.steps:
            out[mc.SD_ON_FRACTION] = self.sd_on_steps / self.steps
            out[mc.SD_SPEC_STEP_FRACTION] = self.spec_steps / self.steps
        if self.draft_seq_steps:
            out[mc.SD_ACCEPT_LEN] = 1.0 + self.accepted_total / self.draft_seq_steps
            out["sd/verify_tokens"] = self.verify_tokens_total / self.draft_seq_steps
        for k, (a, d) in enumerate(zip(self.accepted_pos, self.drafted_pos, strict=True), start=1):
            if d:
                out[f"sd/accept_rate_pos_{k}"] = a / d
        for name, n in sorted(self.arms.items()):
            out[f"sd/arm/{name}"] = float(n)
        for key, totals in ((mc.TOKENS_PER_S_FULL, self.full), (mc.TOKENS_PER_S_TAIL, self.tail)):
            if totals.tokens_per_s is not None:
                out[key] = totals.tokens_per_s
        if self.tail.steps:
            out[mc.TAIL_S] = self.tail.seconds
            out[mc.TAIL_SD_S] = self.tail_sd.seconds
        for key, totals in ((mc.SEQ_TOKENS_PER_S_TAIL_SD, self.tail_sd), (mc.SEQ_TOKENS_PER_S_TAIL_PLAIN, self.tail_plain)):
            if totals.seq_tokens_per_s is not None:
                out[key] = totals.seq_tokens_per_s
        for b, totals in sorted(self.buckets.items()):
            if totals.tokens_per_s is not None:
                out[f"perf/tokens_per_s_bucket/{self.scheme.label(b)}"] = totals.tokens_per_s
            if totals.seq_tokens_per_s is not None:
                out[f"perf/seq_tokens_per_s_bucket/{self.scheme.label(b)}"] = totals.seq_tokens_per_s
        if self.costs is not None:
            out.update(self.costs.summary())
        return out

    def per_bucket(self) -> list[dict]:
        """Rows for a benchmark table ("adaptive vs SD off per bucket"): bucket label, steps, SD-on steps, tokens,
        seconds, tokens/s, tokens/s of one sequence, and the switch-on steps of each arm ({"none": ..., ...})."""
        return [{"bucket": self.scheme.label(b), "steps": t.steps, "sd_on_steps": self.bucket_sd_steps[b],
                 "tokens": t.tokens, "seconds": t.seconds, "tokens_per_s": t.tokens_per_s,
                 "seq_tokens_per_s": t.seq_tokens_per_s,
                 "arms": dict(sorted(self.bucket_arms.get(b, Counter()).items()))}
                for b, t in sorted(self.buckets.items())]
