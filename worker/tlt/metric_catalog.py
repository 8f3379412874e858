"""The metric catalogue: every metric a training run writes, with its unit, its kind and what it means.

The reporters (file_reporter.FileReporter, worker/db_reporter.DbReporter) refuse a name that is not here, the API
serves the catalogue at GET /api/v1/metrics/catalog, and the dashboard reads units and kinds from it. A name is
either literal (`reward/mean`) or a template whose `{field}` parts stand for one path segment (`sd/arm/{arm}`).

Kinds: `per-step` (a value of this step alone), `cumulative` (a running total since the job started: never draw it
as a per-step quantity), `histogram` (a whole distribution per step, written through `Reporter.histogram`).
Unit `fraction` means a value in [0, 1] (the dashboard draws it on a 0-1 axis).

    spec = lookup("sd/arm/none")            # MetricSpec(name="sd/arm/{arm}", unit="steps", ...)
    check_names(["reward/mean", "oops"])    # ValueError naming "oops"

Run the tests: `python -m pytest tests/ui/test_metric_catalog.py -q`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from typing import Literal

MetricKind = Literal["per-step", "cumulative", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    name: str  # literal name, or a template with {field} path segments
    unit: str  # "fraction" is a value in [0, 1]
    kind: MetricKind
    meaning: str


# Names the library writes from more than one place, or that the dashboard keys on.
RESPONSE_LENGTH = "response_length"
REWARD_MEAN = "reward/mean"
TIMING_GEN, TIMING_DRAFTER, TIMING_STEP = "timing_s/gen", "timing_s/drafter", "timing_s/step"
TOKENS_PER_S = "perf/tokens_per_s"
TOKENS_PER_S_FULL, TOKENS_PER_S_TAIL = "perf/tokens_per_s_full", "perf/tokens_per_s_tail"
SEQ_TOKENS_PER_S_TAIL_SD, SEQ_TOKENS_PER_S_TAIL_PLAIN = "perf/seq_tokens_per_s_tail_sd", "perf/seq_tokens_per_s_tail_plain"
TAIL_S, TAIL_SD_S = "perf/tail_s", "perf/tail_sd_s"
SD_PLAIN_ESTIMATE_S, SD_SAVED_S, SD_SAVED_S_TOTAL = "sd/plain_estimate_s", "sd/saved_s", "sd/saved_s_total"
SD_ON_FRACTION, SD_SPEC_STEP_FRACTION, SD_ACCEPT_LEN = "sd/on_fraction", "sd/spec_step_fraction", "sd/accept_len"
DRAFTER_LOSS, DRAFTER_ACC, DRAFTER_STEPS = "drafter/loss", "drafter/acc", "drafter/steps"
HARVEST_IDLE, HARVEST_USED, HARVEST_RATIO = "harvest/idle_gpu_s", "harvest/used_gpu_s", "harvest/ratio"
HARVEST_IDLE_TOTAL, HARVEST_USED_TOTAL = "harvest/idle_gpu_s_total", "harvest/used_gpu_s_total"

_STEP: MetricKind = "per-step"
_CUM: MetricKind = "cumulative"

CATALOG: tuple[MetricSpec, ...] = (
    # --- response lengths (verl names)
    MetricSpec(RESPONSE_LENGTH, "tokens", "histogram", "Response lengths of the step's rollout, as a histogram."),
    *(MetricSpec(f"response_length/{k}", "tokens", _STEP, f"{what} response length of the step's rollout.")
      for k, what in (("mean", "Mean"), ("max", "Longest"), ("min", "Shortest"), ("p50", "Median"),
                      ("p90", "90th-percentile"))),
    MetricSpec("response_length/clip_ratio", "fraction", _STEP,
               "Responses cut at max_completion_length / all responses of the step."),
    # --- reward
    MetricSpec(REWARD_MEAN, "reward", _STEP, "Mean reward of the step's responses."),
    MetricSpec("reward/std", "reward", _STEP, "Standard deviation of the step's rewards."),
    MetricSpec("reward/{func}/mean", "reward", _STEP, "Mean score of one reward function on the step's responses."),
    MetricSpec("frac_reward_zero_std", "fraction", _STEP,
               "Groups whose responses all got the same reward (no learning signal) / all groups."),
    # --- policy update
    MetricSpec("actor/pg_loss", "loss", _STEP, "Policy-gradient loss of the update."),
    MetricSpec("actor/entropy", "nats/token", _STEP, "Mean token entropy of the policy on the step's responses."),
    MetricSpec("actor/kl", "nats/token", _STEP, "Mean KL to the reference policy (0 without a reference)."),
    MetricSpec("actor/grad_norm", "norm", _STEP, "Gradient norm before clipping."),
    MetricSpec("actor/clipfrac", "fraction", _STEP, "Tokens whose probability ratio was clipped / all tokens."),
    MetricSpec("actor/lr", "lr", _STEP, "Learning rate of the update."),
    MetricSpec("actor/num_groups_used", "groups", _STEP, "Groups kept for the update (dynamic sampling drops some)."),
    MetricSpec("rollout/logp_abs_diff", "nats", _STEP,
               "Mean |log-prob at rollout - log-prob recomputed by the trainer| per token (train/rollout mismatch)."),
    MetricSpec("rollout/logp_abs_diff_max", "nats", _STEP, "Largest per-token train/rollout log-prob difference."),
    MetricSpec("rollout/ppl_ratio", "ratio", _STEP, "Perplexity at rollout / perplexity recomputed by the trainer."),
    # --- step time
    MetricSpec(TIMING_GEN, "s", _STEP, "Rollout (generation) wall time of the step."),
    MetricSpec("timing_s/reward", "s", _STEP, "Reward time left after the rollout (rewards overlap the tail)."),
    MetricSpec("timing_s/reward_work", "s", _STEP, "Total reward computation time, overlapped or not."),
    MetricSpec("timing_s/update", "s", _STEP, "Policy update wall time."),
    MetricSpec("timing_s/sync", "s", _STEP, "Weight sync to the rollout engine."),
    MetricSpec(TIMING_DRAFTER, "s", _STEP, "Drafter training run after the update (outside the rollout's tail)."),
    MetricSpec("timing_s/val", "s", _STEP, "Validation wall time (steps that validate)."),
    MetricSpec("timing_s/kv_restore", "s", _STEP, "Re-allocating the KV cache released for the update."),
    MetricSpec("timing_s/sleep", "s", _STEP, "Putting vLLM to sleep after the rollout (rollout.backend vllm, "
               "release_kv_for_update on CUDA)."),
    MetricSpec(TIMING_STEP, "s", _STEP, "Whole RL step wall time."),
    # --- throughput
    MetricSpec(TOKENS_PER_S, "tokens/s", _STEP, "Response tokens of the step / rollout wall time."),
    MetricSpec(TOKENS_PER_S_FULL, "tokens/s", _STEP,
               "Tokens / seconds over decode steps with a full batch (active >= rollout.sd_on_below)."),
    MetricSpec(TOKENS_PER_S_TAIL, "tokens/s", _STEP,
               "Tokens / seconds over the long tail's decode steps (active < rollout.sd_on_below), SD or not."),
    MetricSpec(SEQ_TOKENS_PER_S_TAIL_SD, "tokens/s/seq", _STEP,
               "Tail decode steps that drafted and verified: tokens / (active sequences x seconds), the speed of one "
               "sequence with SD."),
    MetricSpec(SEQ_TOKENS_PER_S_TAIL_PLAIN, "tokens/s/seq", _STEP,
               "Tail decode steps that decoded plainly: tokens / (active sequences x seconds), the speed of one "
               "sequence without SD. The tail speed-up is _sd / _plain."),
    MetricSpec(TAIL_S, "s", _STEP, "Wall seconds of the long tail's decode steps (active < rollout.sd_on_below)."),
    MetricSpec(TAIL_SD_S, "s", _STEP, "Wall seconds of the tail's decode steps that drafted and verified."),
    MetricSpec("perf/tokens_per_s_bucket/{bucket}", "tokens/s", _STEP, "Tokens / seconds per batch-size bucket."),
    MetricSpec("perf/seq_tokens_per_s_bucket/{bucket}", "tokens/s/seq", _STEP,
               "Per batch-size bucket: tokens / (active sequences x seconds)."),
    MetricSpec("perf/tail_hook_s", "s", _STEP, "Drafter training run between tail decode steps of the rollout."),
    MetricSpec("perf/tail_hook_calls", "calls", _STEP, "Tail-hook calls (drafter training slots) in the rollout."),
    MetricSpec("perf/kv_released_gb", "GB", _STEP, "KV-cache memory released for the policy update."),
    MetricSpec("perf/optimizer_state_mib", "MiB", _STEP, "Optimizer state held (the fullest rank)."),
    MetricSpec("perf/peak_mem_mib", "MiB", _STEP, "Peak GPU memory allocated (the fullest rank)."),
    MetricSpec("perf/gpu{rank}/optimizer_state_mib", "MiB", _STEP, "Optimizer state held by one rank."),
    MetricSpec("perf/gpu{rank}/peak_mem_mib", "MiB", _STEP, "Peak GPU memory allocated by one rank."),
    # --- speculative decoding
    MetricSpec(SD_ON_FRACTION, "fraction", _STEP,
               "Decode steps with the SD switch on / all decode steps (the bandit may still pick arm 'none'; "
               "without the adaptive controller: tokens emitted by speculative steps / all tokens)."),
    MetricSpec(SD_SPEC_STEP_FRACTION, "fraction", _STEP,
               "Decode steps that really drafted and verified / all decode steps (where SD ran)."),
    MetricSpec(SD_ACCEPT_LEN, "tokens", _STEP,
               "Tokens emitted per sequence per verify: accepted drafts + 1 (1.0 = no draft accepted)."),
    MetricSpec("sd/verify_tokens", "tokens", _STEP, "Mean verify width per sequence on drafting steps (root included)."),
    MetricSpec("sd/accept_rate_pos_{k}", "fraction", _STEP,
               "Sequences whose k-th draft token was accepted / sequences that had a k-th draft token."),
    MetricSpec("sd/arm/{arm}", "steps", _STEP,
               "Switch-on decode steps that ran this arm in the step's rollout (a count; 'none' = plain decoding). "
               "Shares are count / sum over arms."),
    MetricSpec("sd/gain/{bucket}", "ratio", _STEP,
               "Per batch-size bucket, as measured so far: one sequence's tokens/s in SD steps / in plain steps."),
    MetricSpec("sd/pays/{bucket}", "on/off", _STEP,
               "Per batch-size bucket: 1 when the measured step costs switch SD on there, 0 when off."),
    MetricSpec(SD_PLAIN_ESTIMATE_S, "s", _STEP,
               "Cost-model estimate of the seconds plain decoding would have taken for the tokens the tail's SD "
               "steps emitted (one sequence's plain tail speed applied to them)."),
    MetricSpec(SD_SAVED_S, "s", _STEP,
               "Time SD saved in this step's tail: sd/plain_estimate_s - perf/tail_sd_s (negative = SD cost time)."),
    MetricSpec(SD_SAVED_S_TOTAL, "s", _CUM, "Time SD saved in the tail since the job started, or since its last resume (sum of sd/saved_s)."),
    MetricSpec("sd/step_s_plain/{bucket}", "s", _STEP,
               "Per batch-size bucket, as measured so far: seconds of a plain decode step (what the cost switch uses)."),
    MetricSpec("sd/step_s_sd/{bucket}", "s", _STEP,
               "Per batch-size bucket, as measured so far: seconds of a speculative step of the best SD arm."),
    MetricSpec("sd/accepted_draft_tokens", "tokens", _STEP, "Draft tokens accepted in the rollout."),
    MetricSpec("sd/verify_steps", "steps", _STEP, "Verify steps observed."),
    # --- drafter
    MetricSpec(DRAFTER_LOSS, "loss", _STEP, "Drafter training loss, mean over the step's drafter updates."),
    MetricSpec(DRAFTER_ACC, "fraction", _STEP, "Drafter top-1 agreement with the target, over the step's updates."),
    MetricSpec(DRAFTER_STEPS, "steps", _CUM, "Drafter optimizer steps since the job started."),
    MetricSpec("drafter/harvest_steps", "steps", _STEP, "Drafter optimizer steps taken in this step's idle time."),
    MetricSpec("drafter/buffer_rows", "rows", _STEP, "Hidden-state rows in the drafter's training buffer."),
    # --- idle-time harvesting (GPU-seconds summed over GPUs; on CPU the process's seconds)
    MetricSpec(HARVEST_IDLE, "GPU-s", _STEP,
               "Idle time offered to drafter training in this step: the rollout's tail (single device) or each "
               "rank's wait for the others (multi-GPU)."),
    MetricSpec(HARVEST_USED, "GPU-s", _STEP, "Part of this step's idle time that drafter training used."),
    MetricSpec(HARVEST_RATIO, "fraction", _STEP, "harvest/used_gpu_s / harvest/idle_gpu_s of this step (<= 1)."),
    MetricSpec(HARVEST_IDLE_TOTAL, "GPU-s", _CUM, "Idle time offered to drafter training since the job started."),
    MetricSpec(HARVEST_USED_TOTAL, "GPU-s", _CUM, "Idle time used by drafter training since the job started."),
    MetricSpec("harvest/gpu{rank}/idle_gpu_s", "GPU-s", _STEP, "One rank's idle time in this step."),
    MetricSpec("harvest/gpu{rank}/used_gpu_s", "GPU-s", _STEP, "One rank's idle time used by drafter training."),
    *(MetricSpec(f"timeline/gpu{{rank}}/{phase}_s", "s", _STEP, f"One rank's {what} in this step (GPU timeline).")
      for phase, what in (("rollout", "rollout of its shard"), ("drafter", "drafter training in idle time"),
                          ("idle", "idle time left unused"), ("reward", "reward time"), ("update", "policy update"),
                          ("sync", "weight sync and drafter time"))),
    # --- validation and layout
    MetricSpec("val/pass@1", "fraction", _STEP, "Validation prompts whose greedy answer scores 1 / all prompts."),
    MetricSpec("val/reward_mean", "reward", _STEP, "Mean reward on the validation prompts."),
    MetricSpec("val/response_length_mean", "tokens", _STEP, "Mean response length on the validation prompts."),
    MetricSpec("dist/world_size", "ranks", _STEP, "Ranks that ran the step."),
)


def _pattern(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[a-z_]+\})", template)
    return re.compile("".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts) + r"\Z")


@cache
def _index() -> tuple[dict[str, MetricSpec], list[tuple[re.Pattern[str], MetricSpec]]]:
    exact = {m.name: m for m in CATALOG if "{" not in m.name}
    templates = [(_pattern(m.name), m) for m in CATALOG if "{" in m.name]
    return exact, templates


def lookup(name: str) -> MetricSpec | None:
    """The catalogue entry of a written name (a literal entry first, then the first matching template)."""
    exact, templates = _index()
    if name in exact:
        return exact[name]
    return next((m for p, m in templates if p.match(name)), None)


def check_names(names: Iterable[str]) -> None:
    """Raise ValueError naming every name that the catalogue lacks (a reporter writes nothing then)."""
    unknown = sorted({n for n in names if lookup(n) is None})
    if unknown:
        raise ValueError(f"metric names not in worker/tlt/metric_catalog.py: {', '.join(unknown)}")
