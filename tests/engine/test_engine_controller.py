"""The engine runs any `SdController` (rollout/controller_protocol.py), not only speculative/control/'s `AdaptiveSd`: a hand-written
controller that alternates plain and n-gram steps drives a greedy generate() token-identical to plain decoding, sees
every step it planned recorded with that step's emitted count, sizes the KV headroom and returns its metrics; one
generate() can run under another controller (`controller=`: no hidden-state capture, no tail hook, the engine's own
controller untouched); and
`AdaptiveSd` has every member of the protocol (mypy checks the annotated assignments below; run
`mypy tests/engine/test_engine_controller.py` after changing either side).
Run: python -m pytest tests/engine/test_engine_controller.py -q"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from worker.tlt.rollout.controller_protocol import SdController
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import NO_SD, Arm, chain_arm
from worker.tlt.speculative.control.arm_buckets import arms_table
from worker.tlt.speculative.control.bandit import BanditConfig, make_bandit
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.control.switch import SwitchConfig
from worker.tlt.speculative.proposers.ngram import NGramProposer

TARGET = tiny_target()
EOS = (257,)
CHAIN = chain_arm("ngram", 3)


@dataclass(frozen=True)
class _Settings:
    mode: str = "adaptive"
    off_threshold: int = 4


class _Switch:
    def __init__(self) -> None:
        self.on = False
        self.config = _Settings()


class _Buckets:
    def bucket(self, active: int) -> int:
        return 0 if active < 2 else 1


class _Log:
    def __init__(self) -> None:
        self.rows: list[tuple[int, str, int, bool]] = []  # (active, arm, emitted, sd_on) per recorded step

    def summary(self) -> dict[str, float]:
        return {"steps": float(len(self.rows)), "tokens": float(sum(r[2] for r in self.rows))}

    def per_bucket(self) -> list[dict]:
        return [{"arm": name, "steps": sum(r[1] == name for r in self.rows)} for name in ("none", CHAIN.name)]


class Alternating:
    """No bandit, no controller state: SD on below 4 active sequences, and then the n-gram chain every other step."""

    def __init__(self) -> None:
        self.switch, self.scheme, self.metrics = _Switch(), _Buckets(), _Log()
        self.rollouts = 0
        self.plans = 0

    def start_rollout(self) -> None:
        self.rollouts += 1
        self.metrics = _Log()

    def plan(self, active: int) -> Arm:
        self.switch.on = active < self.switch.config.off_threshold
        self.plans += 1
        return CHAIN if self.switch.on and self.plans % 2 else NO_SD

    def record(self, active: int, arm: Arm, emitted: int, seconds: float, accepted_per_pos: Sequence[int] = (),
               drafted_per_pos: Sequence[int] | None = None, *, sd_on: bool | None = None) -> None:
        assert seconds > 0 and sd_on is not None
        self.metrics.rows.append((active, arm.name, emitted, sd_on))

    def all_arms(self) -> list[Arm]:
        return [NO_SD, CHAIN]

    def arms_for(self, active: int) -> list[Arm]:
        return [CHAIN] if active < self.switch.config.off_threshold else []


class Wide(Alternating):
    """An Alternating controller whose arms draft `depth` tokens with `drafter`."""

    def __init__(self, drafter: str = "ngram", depth: int = 3) -> None:
        super().__init__()
        self.chain = chain_arm(drafter, depth)  # type: ignore[arg-type]

    def all_arms(self) -> list[Arm]:
        return [NO_SD, self.chain]


def _engine(ctl: SdController | None, **kw) -> Engine:
    return Engine(TARGET, eos_ids=EOS, config=EngineConfig(max_len=128, max_slots=4, sync_every=4), controller=ctl,
                  proposers={"ngram": NGramProposer()} if ctl is not None else None, **kw)


def test_the_engine_runs_a_controller_of_its_own_protocol() -> None:
    prompts = [p * 3 for p in random_prompts(4, seed=5, lo=3, hi=9)]  # repeats: the n-gram drafter matches
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=8 + 6 * i)) for i, p in enumerate(prompts)]
    ctl = Alternating()
    eng = _engine(ctl)
    assert eng.state.max_nodes == CHAIN.verify_tokens  # the headroom of the widest arm it reported
    out = eng.generate(reqs)
    base = _engine(None).generate(reqs)
    assert [s.tokens for s in out.sequences] == [s.tokens for s in base.sequences]
    assert ctl.rollouts == 1
    steps = [s for s in out.steps if s.kind != "prefill"]
    # every step it planned came back, in order, with the step's emitted count and the arm it ran
    assert [(s.active, s.arm, s.emitted) for s in steps] == [r[:3] for r in ctl.metrics.rows]
    assert {s.arm for s in steps if s.kind == "spec"} == {CHAIN.name}
    assert any(s.kind == "decode" and s.active < 4 for s in steps)  # SD on, plain step in between
    assert all(s.active < 4 for s in steps if s.kind == "spec")
    assert out.sd_metrics == ctl.metrics.summary() and out.sd_buckets == ctl.metrics.per_bucket()


def test_adaptive_sd_is_an_sd_controller() -> None:
    fixed: SdController = AdaptiveSd.fixed(CHAIN)
    bandit = make_bandit(arms_table(["ngram"]), BanditConfig(kind="epsilon_greedy"), seed=0)
    adaptive: SdController = AdaptiveSd(SwitchConfig(mode="adaptive", on_below=4, patience=1), bandit)
    for ctl in (fixed, adaptive, Alternating()):
        assert isinstance(ctl, SdController)
    assert not isinstance(object(), SdController)
    # the members the engine reads through the protocol hold what it expects
    assert fixed.switch.config.mode == "on" and fixed.arms_for(1) == [CHAIN]
    assert adaptive.switch.config.off_threshold == 6 and adaptive.scheme.bucket(30) == 3


def test_one_generate_under_another_controller() -> None:
    prompts = [p * 3 for p in random_prompts(4, seed=5, lo=3, hi=9)]
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=8 + 6 * i)) for i, p in enumerate(prompts)]
    captured: list[int] = []
    tail_calls: list[float] = []
    own, other = Alternating(), Alternating()
    eng = _engine(own, hidden_hook=lambda ids, toks, hidden: captured.append(len(ids)), tail_hook=tail_calls.append)
    base = _engine(None).generate(reqs)
    out = eng.generate(reqs, controller=other)
    assert [s.tokens for s in out.sequences] == [s.tokens for s in base.sequences]
    assert (own.rollouts, other.rollouts) == (0, 1) and not own.metrics.rows
    steps = [s for s in out.steps if s.kind != "prefill"]
    assert [(s.active, s.arm, s.emitted) for s in steps] == [r[:3] for r in other.metrics.rows]
    assert out.sd_metrics == other.metrics.summary()  # no perf/tail_hook_* keys: the hook was off
    assert captured == [] and tail_calls == []
    assert eng.hidden_hook is not None and eng.controller is own  # only that call ran without them
    again = eng.generate(reqs)
    assert own.rollouts == 1 and captured and "perf/tail_hook_calls" in again.sd_metrics
    assert [s.tokens for s in again.sequences] == [s.tokens for s in base.sequences]


def test_another_controller_must_fit_the_engine() -> None:
    eng = _engine(Alternating())
    reqs = [Request([1, 2, 3], RequestSampling(temperature=0.0, max_new_tokens=4))]
    with pytest.raises(ValueError, match="drafters"):
        eng.generate(reqs, controller=Wide("eagle"))
    with pytest.raises(ValueError, match="KV headroom"):
        eng.generate(reqs, controller=Wide(depth=CHAIN.depth + 1))
    with pytest.raises(ValueError, match="plain"):
        eng.generate(reqs, plain=True, controller=Alternating())
    assert eng.generate(reqs, controller=Wide(depth=1)).sequences[0].finish_reason == "length"
