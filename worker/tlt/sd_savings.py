"""Time saved by speculative decoding in a job's long tail: the tail seconds SD steps took vs the cost model's
estimate of what plain decoding would have taken for the same tokens.

The cost model: in the tail, one sequence decodes plainly at `perf/seq_tokens_per_s_tail_plain` tokens/s and with SD
at `perf/seq_tokens_per_s_tail_sd` (both tokens / sum of active x seconds, speculative/control/sd_metrics.py). Plain decoding of the
tokens the SD steps emitted, at the same batch sizes, takes their seconds x (SD rate / plain rate). The plain rate is
this step's, else the newest one seen (a step whose tail drafted on every step measured none); with no plain rate yet
nothing is estimated. The estimate ignores that plain decoding would shift which batch sizes the tail runs at.

    savings = SdSavings()
    metrics.update(savings.observe(metrics))   # sd/plain_estimate_s, sd/saved_s, sd/saved_s_total
    savings.summary()                          # "SD saved 12.3 s of tail time (40.1 s with SD vs 52.4 s plain est.)"

Run the tests: `python -m pytest tests/train/test_train_sd_savings.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.tlt import metric_catalog as mc


def plain_estimate_s(sd_seconds: float, seq_rate_sd: float, seq_rate_plain: float) -> float:
    """Seconds plain decoding would take for the tokens SD steps emitted in `sd_seconds` (rates per sequence)."""
    if seq_rate_plain <= 0 or seq_rate_sd < 0 or sd_seconds < 0:
        raise ValueError(f"need rates > 0 and seconds >= 0 (sd {seq_rate_sd}, plain {seq_rate_plain}, s {sd_seconds})")
    return sd_seconds * seq_rate_sd / seq_rate_plain


@dataclass
class SdSavings:
    """Running time-saved account of one job (since it started or resumed)."""

    plain_rate: float | None = None  # newest plain per-sequence tail rate seen
    sd_s_total: float = 0.0  # tail seconds spent in SD steps that were priced
    plain_s_total: float = 0.0  # their plain estimate
    saved_s_total: float = 0.0
    priced_steps: int = 0

    def observe(self, metrics: dict[str, float]) -> dict[str, float]:
        """The time-saved metrics of one RL step's metrics; {} when the step's tail ran no SD or no plain rate is
        known yet."""
        plain = metrics.get(mc.SEQ_TOKENS_PER_S_TAIL_PLAIN)
        if plain is not None and plain > 0:
            self.plain_rate = plain
        sd_s, sd_rate = metrics.get(mc.TAIL_SD_S, 0.0), metrics.get(mc.SEQ_TOKENS_PER_S_TAIL_SD)
        if sd_s <= 0 or sd_rate is None or self.plain_rate is None:
            return {}
        estimate = plain_estimate_s(sd_s, sd_rate, self.plain_rate)
        saved = estimate - sd_s
        self.sd_s_total += sd_s
        self.plain_s_total += estimate
        self.saved_s_total += saved
        self.priced_steps += 1
        return {mc.SD_PLAIN_ESTIMATE_S: estimate, mc.SD_SAVED_S: saved, mc.SD_SAVED_S_TOTAL: self.saved_s_total}

    def summary(self) -> str:
        """One clause for the job's closing log line."""
        if not self.priced_steps:
            return "SD saved no measurable tail time (no step's tail ran SD beside a plain-rate measurement)"
        return (f"SD saved {self.saved_s_total:.1f} s of tail time over {self.priced_steps} steps "
                f"({self.sd_s_total:.1f} s with SD vs {self.plain_s_total:.1f} s plain estimate)")
