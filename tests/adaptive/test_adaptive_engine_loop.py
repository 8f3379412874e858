"""The adaptive rollout engine end to end on a tiny random model: the controller switches SD on mid-generation (no
re-prefill) and the bandit moves between plain decoding and several drafters / arms (chains and a tree) inside one
generate(), and greedy output stays token-identical to plain greedy decoding; sampled tokens made by alternating
arms follow the exact target law (chi-square, with a negative control); sampling is reproducible for a seed;
the rollout's sd/* and perf/* metrics come back on GenerationOutput; the tail hook is bounded; KV headroom covers
the widest arm. Run: python -m pytest tests/adaptive/test_adaptive_engine_loop.py -q"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pytest
import torch
from scipy.stats import chisquare

from worker.tlt.decoding.draft_types import DraftProposal
from worker.tlt.decoding.sampling import DraftFilters
from worker.tlt.model.args import preset
from worker.tlt.model.load import random_model
from worker.tlt.rollout import adaptive_loop
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, GenerationOutput, Request, RequestSampling
from worker.tlt.rollout.windows import PlainWindows
from worker.tlt.selfcheck import exact_pair_law
from worker.tlt.speculative.arm import NO_SD, Arm
from worker.tlt.speculative.control.arm_buckets import arms_table
from worker.tlt.speculative.control.bandit import BanditConfig, make_bandit
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.control.switch import SwitchConfig, SwitchMode
from worker.tlt.speculative.proposers.ngram import NGramProposer
from worker.tlt.speculative.proposers.protocol import DraftContext, Proposer
from worker.tlt.speculative.proposers.small_model import SmallModelProposer

TARGET = tiny_target()
DRAFTER = perturbed_copy(TARGET, noise=0.15)
EOS = (257,)


class FakeClock:
    """Deterministic step timing: every reading advances 1 ms, so the bandit's choices repeat exactly."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1e-3
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def controller(on_below: int = 4, seed: int = 0) -> AdaptiveSd:
    """Every arm explored twice per bucket first, then epsilon-greedy with a high epsilon: the arm changes often."""
    table = arms_table(["ngram", "small"])  # n-gram chains; small-model chains and a d6k4 tree per bucket
    # loss_budget=None: these tests exercise the hand-over between arms, so every arm must keep being played
    bandit = make_bandit(table, BanditConfig(kind="epsilon_greedy", epsilon=0.5, min_pulls=2, loss_budget=None),
                         seed=seed)
    return AdaptiveSd(SwitchConfig(mode="adaptive", on_below=on_below, patience=1), bandit)


def engine(ctl: AdaptiveSd | None, slots: int, clock: FakeClock | None = None, **kw) -> Engine:
    proposers: dict[str, Proposer] | None = None
    if ctl is not None:
        proposers = {"ngram": NGramProposer(), "small": SmallModelProposer(DRAFTER)}
    return Engine(TARGET, eos_ids=EOS, config=EngineConfig(max_len=200, max_slots=slots, sync_every=4),
                  controller=ctl, proposers=proposers, clock=clock or FakeClock(), **kw)


def requests(temperature: float, n_prompts: int = 5, n: int = 2) -> list[Request]:
    prompts = [p * 3 for p in random_prompts(n_prompts, seed=5, lo=3, hi=9)]  # repeats: the n-gram drafter matches
    budgets = [10, 14, 18, 22, 120]  # a long tail: the last group outlives the others by ~100 tokens
    return [Request(p, RequestSampling(temperature=temperature, max_new_tokens=budgets[i % 5], n=n))
            for i, p in enumerate(prompts)]


def arm_sequence(out: GenerationOutput) -> list[str | None]:
    return [s.arm for s in out.steps if s.kind != "prefill"]


class ScriptedSd(AdaptiveSd):
    """The real switch (off while >= on_below active), then a fixed cycle of arms: SD goes on and off every few
    steps, through every drafter and shape, so the engine's hand-over between them is exercised deterministically."""

    CYCLE = ("none", "ngram-c3", "small-d6k4v32", "none", "none", "small-c6", "ngram-c6", "small-c3",
             "small-d6k4v48", "none", "small-d6k4v8", "ngram-c3", "small-d6k4v16")

    def __init__(self, cycle: tuple[str, ...] = CYCLE, mode: SwitchMode = "adaptive") -> None:
        super().__init__(SwitchConfig(mode=mode, on_below=4, patience=1), controller().bandit)
        self.by_name: dict[str, Arm] = {a.name: a for a in self.all_arms()}
        self.cycle = cycle
        self.i = 0

    def plan(self, active: int) -> Arm:
        if not self.switch.update(active):
            return NO_SD
        self.i += 1
        return self.by_name[self.cycle[(self.i - 1) % len(self.cycle)]]


def _assert_same(out: GenerationOutput, base: GenerationOutput) -> None:
    assert [s.tokens for s in out.sequences] == [s.tokens for s in base.sequences]
    assert [s.finish_reason for s in out.sequences] == [s.finish_reason for s in base.sequences]
    for a, b in zip(out.sequences, base.sequences, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def _run_ahead(monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    """Plain windows one ahead of their reads (as on CUDA) or read at once, forced for the adaptive loop on CPU."""
    monkeypatch.setattr(adaptive_loop, "PlainWindows", functools.partial(PlainWindows, overlap=overlap))


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_identical_with_sd_switching_on_and_off_inside_generate(overlap: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = requests(0.0)
    base = engine(None, slots=6).generate(reqs)
    _run_ahead(monkeypatch, overlap)
    ctl = ScriptedSd()
    out = engine(ctl, slots=6).generate(reqs)  # 10 sequences through 6 slots: a full phase, then the tail
    _assert_same(out, base)
    # every step reached the controller once, plain steps when their window was read (a window late with overlap)
    assert ctl.metrics.steps == sum(s.kind != "prefill" for s in out.steps)
    steps = [s for s in out.steps if s.kind != "prefill"]
    # plain decoding while the batch is full, SD only once fewer than on_below=4 are active; no re-prefill: the
    # only prefills are the admission waves (6 slots, 10 sequences)
    assert steps[0].kind == "decode" and steps[0].active >= 4
    assert all(s.active < 4 for s in steps if s.kind == "spec")
    assert sum(s.kind == "prefill" for s in out.steps) <= 1 + len(reqs) * 2 - 6
    tail = [s.arm for s in steps if s.active < 4]
    assert set(tail) >= set(ScriptedSd.CYCLE) - {"small-d6k4v48", "small-d6k4v16", "small-d6k4v8"}  # what ran
    assert any(a and "k4v" in a for a in tail)  # a tree
    flips = sum((x == "none") != (y == "none") for x, y in zip(tail, tail[1:], strict=False))
    assert flips >= 6  # SD off -> on -> off ... inside the tail
    spec = [s for s in out.steps if s.kind == "spec"]
    assert 0 < sum(s.accepted for s in spec) < sum(s.active * (s.verify_tokens - 1) for s in spec)


def test_hook_rows_the_same_with_windows_read_a_window_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """With windows read one late (rows moved by syncs in between, SD steps between windows), the hidden-state hook
    still gets every position of every sequence once, in order, with its hidden state."""
    reqs = requests(0.0)

    def rows(overlap: bool) -> dict[tuple[int, int], tuple[list[int], torch.Tensor]]:
        got: dict[tuple[int, int], tuple[list[int], list[torch.Tensor]]] = {}

        def hook(seq_ids: Sequence[tuple[int, int]], toks: torch.Tensor, hidden: torch.Tensor) -> None:
            for sid, t, h in zip(list(seq_ids), toks.tolist(), hidden, strict=True):
                got.setdefault(sid, ([], []))[0].append(t)
                got[sid][1].append(h)

        _run_ahead(monkeypatch, overlap)
        out = engine(ScriptedSd(), slots=6, hidden_hook=hook).generate(reqs)
        for s in out.sequences:  # the response's positions after the prefill: all but the last token entered the cache
            assert got[(s.request, s.sample)][0][-(len(s.tokens) - 1):] == s.tokens[:-1]
        return {k: (t, torch.stack(h)) for k, (t, h) in got.items()}

    want, have = rows(False), rows(True)
    assert want.keys() == have.keys()
    for k, (toks, hid) in want.items():
        assert have[k][0] == toks
        torch.testing.assert_close(have[k][1], hid, atol=1e-4, rtol=1e-4)


def test_greedy_identical_with_the_bandit() -> None:
    reqs = requests(0.0)
    out = engine(controller(), slots=6).generate(reqs)
    _assert_same(out, engine(None, slots=6).generate(reqs))
    assert len({s.arm for s in out.steps if s.kind == "spec"}) >= 4  # forced exploration reached several arms


def test_sampling_reproducible_and_sd_used() -> None:
    reqs = requests(1.0)
    outs = [engine(controller(), slots=10).generate(reqs) for _ in range(2)]
    assert [s.tokens for s in outs[0].sequences] == [s.tokens for s in outs[1].sequences]
    assert arm_sequence(outs[0]) == arm_sequence(outs[1])
    assert any(s.kind == "spec" for s in outs[0].steps)
    for s in outs[0].sequences:
        assert len(s.tokens) == len(s.logprobs) and all(lp <= 1e-6 for lp in s.logprobs)


@pytest.mark.parametrize("cycle", [("none", "small-d6k4v8"), ("ngram-c3", "none"), ("small-c3",)])
def test_sampling_exact_across_arm_switches(cycle: tuple[str, ...]) -> None:
    """Tokens 2 and 3 of 3000 samples, each made by the arms of `cycle` in turn (one decode step each, or one
    verify emitting both), follow the exact processed target law (chi-square, vocabulary 10)."""
    small = random_model(preset("tiny-qwen2", vocab_size=10, eos_token_ids=()), seed=4, std=0.3)
    prompt, temp, top_p = [3, 1, 4], 0.8, 0.9
    law = exact_pair_law(small, prompt, temp, top_p, 0)
    eng = Engine(small, eos_ids=(), config=EngineConfig(max_len=8, max_slots=3000, seed=7),
                 controller=ScriptedSd(cycle, mode="on"),
                 proposers={"ngram": NGramProposer(), "small": SmallModelProposer(perturbed_copy(small, 0.5))})
    out = eng.generate([Request(prompt, RequestSampling(temperature=temp, top_p=top_p, max_new_tokens=3, n=3000))])
    assert [s.arm for s in out.steps if s.kind != "prefill"][0] == cycle[0]
    counts: dict[tuple[int, int], int] = {}
    for seq in out.sequences:
        key = (seq.tokens[1], seq.tokens[2])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= {k for k, v in law.items() if v > 0}
    assert _pvalue(counts, law) > 1e-4
    # the statistic has power: the same samples against a 25% hotter temperature's law are rejected
    assert _pvalue(counts, exact_pair_law(small, prompt, temp * 1.25, top_p, 0)) < 1e-4


def _pvalue(counts: dict[tuple[int, int], int], law: dict[tuple[int, int], float]) -> float:
    n = sum(counts.values())
    keys = [k for k, v in law.items() if v * n >= 5]  # cells with enough expectation; the rest pooled
    obs = [counts.get(k, 0) for k in keys] + [n - sum(counts.get(k, 0) for k in keys)]
    exp = [law[k] * n for k in keys] + [n * (1 - sum(law[k] for k in keys))]
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    exp = [e * sum(obs) / sum(exp) for e in exp]  # exact normalisation for scipy
    return float(chisquare(obs, exp).pvalue)


def test_rollout_metrics_on_output() -> None:
    out = engine(controller(), slots=10).generate(requests(1.0))
    m = out.sd_metrics
    assert 0.0 < m["sd/on_fraction"] < 1.0
    assert m["sd/accept_len"] >= 1.0 and 0.0 <= m["sd/accept_rate_pos_1"] <= 1.0
    assert sum(v for k, v in m.items() if k.startswith("sd/arm/")) == pytest.approx(
        m["sd/on_fraction"] * sum(1 for s in out.steps if s.kind != "prefill"))
    assert m["perf/tokens_per_s_tail"] > 0 and m["perf/tokens_per_s_bucket/1"] > 0
    assert {r["bucket"] for r in out.sd_buckets} >= {"1", "2-4"}
    assert sum(r["tokens"] for r in out.sd_buckets) == out.tokens - sum(s.emitted for s in out.steps
                                                                          if s.kind == "prefill")


def test_tail_hook_is_bounded_and_only_runs_with_sd_on() -> None:
    clock = FakeClock()
    budgets: list[tuple[float, int]] = []
    eng: Engine

    def hook(budget: float) -> None:
        budgets.append((budget, eng.n_active))
        clock.advance(0.02)  # a spot-training step that costs 20 ms, far more than any single grant

    ctl = controller()
    eng = engine(ctl, slots=10, clock=clock, tail_hook=hook)
    out = eng.generate(requests(1.0))
    assert budgets and all(0 < b <= eng.config.tail_credit_cap_s for b, _ in budgets)
    assert all(active < 4 for _, active in budgets)  # the tail only
    on_s = sum(s.seconds for s in out.steps if s.kind != "prefill" and s.active < 4)
    # the hook's time is charged to its credit: fraction x tail time, plus one overrun as the clock reads it (the
    # hook's 20 ms and the fake clock's 1 ms per reading)
    assert out.sd_metrics["perf/tail_hook_s"] <= eng.config.tail_budget * on_s + 0.021 + 1e-9
    assert out.sd_metrics["perf/tail_hook_calls"] == len(budgets)


def test_kv_headroom_for_widest_arm_and_drafters_checked() -> None:
    eng = engine(controller(), slots=2)
    assert eng.max_nodes == 48  # the bucket-1 tree verifies 48 tokens per sequence
    assert eng.cache.max_len >= 200 + 48
    with pytest.raises(ValueError, match="small"):
        Engine(TARGET, eos_ids=EOS, config=EngineConfig(max_len=64, max_slots=2), controller=controller(),
               proposers={"ngram": NGramProposer()})


class ChainSpy(SmallModelProposer):
    """A drafter that keeps chain graphs (as EagleProposer does): records what the engine asks it to capture."""

    def __init__(self) -> None:
        super().__init__(DRAFTER)
        self.captured: list[tuple[list[int], int, DraftFilters]] = []
        self.trees: list[tuple[int, int, int, int]] = []  # (batch, topk, depth, nodes) of each tree drafted
        self.resets = 0

    def capture(self, batches: Sequence[int], depth: int, filters: DraftFilters) -> int:
        self.captured.append((list(batches), depth, filters))
        return len(batches)

    def propose(self, ctx: DraftContext) -> DraftProposal:
        if ctx.topk > 1:
            self.trees.append((ctx.batch_size, ctx.topk, ctx.max_depth, ctx.max_nodes))
        return super().propose(ctx)

    def reset(self) -> None:
        self.resets += 1
        super().reset()


def test_warmup_captures_every_chain_arm_the_switch_can_reach() -> None:
    """Engine._warmup_drafts (part of warmup on CUDA) asks a graph-keeping drafter (Proposer.capture) for every chain arm's draft length
    at every batch SD can run (up to the switch's off threshold), with the sampling filters the rows will have; tree
    arms and batches SD never runs are not asked; mixed per-row settings ask nothing (filters unknown)."""
    table = arms_table(["ngram", "small"])
    ctl = AdaptiveSd(SwitchConfig(mode="adaptive", on_below=4, patience=1),
                     make_bandit(table, BanditConfig(kind="epsilon_greedy"), seed=0))
    spy = ChainSpy()
    eng = Engine(TARGET, eos_ids=EOS, config=EngineConfig(max_len=200, max_slots=16), controller=ctl,
                 proposers={"ngram": NGramProposer(), "small": spy})
    eng._warmup_drafts(16, [RequestSampling(temperature=1.0, top_p=0.9, top_k=50)])
    off_at = ctl.switch.config.off_threshold
    want: dict[int, set[int]] = {}
    for n in range(1, off_at + 1):
        for a in ctl.arms_for(n):
            if a.drafter == "small" and a.topk == 1:
                want.setdefault(min(a.depth, a.verify_tokens - 1), set()).add(n)
    assert want, "the arms table has small-model chain arms"
    assert {d: set(b) for b, d, _ in spy.captured} == want
    assert {f for _, _, f in spy.captured} == {(50, True, 1.0)}
    assert max(max(b) for b, _, _ in spy.captured) <= off_at < 16
    # tree arms draft eagerly: one warm-up draft per (batch bucket, shape) pays their first-use costs, then the
    # drafter forgets the warm-up rows
    want_trees = {(eng.state.bucket(n), a.topk, a.depth, a.verify_tokens)
                  for n in range(1, off_at + 1) for a in ctl.arms_for(n) if a.drafter == "small" and a.topk > 1}
    assert want_trees, "the arms table has small-model tree arms"
    assert sorted(spy.trees) == sorted(want_trees) and spy.resets == 1
    spy.captured.clear()
    spy.trees.clear()
    eng._warmup_drafts(16, [RequestSampling(temperature=1.0), RequestSampling(temperature=0.5)])
    assert spy.captured == [] and spy.trees == []
