"""SdSwitch: hysteresis on the active batch size. Run: `python -m pytest tests/adaptive/test_adaptive_switch.py -q`."""

from __future__ import annotations

import random

import pytest

from worker.tlt.speculative.control.switch import SdSwitch, SwitchConfig


def feed(switch: SdSwitch, actives: list[int]) -> list[bool]:
    return [switch.update(a) for a in actives]


def test_defaults_follow_tlt() -> None:
    cfg = SwitchConfig()
    assert (cfg.on_below, cfg.patience, cfg.off_threshold) == (32, 3, 48)
    assert not SdSwitch(cfg).on  # a rollout starts with a full batch: SD off


def test_turns_on_only_after_patience_consecutive_small_batches() -> None:
    sw = SdSwitch(SwitchConfig(on_below=32, patience=3))
    assert feed(sw, [64, 31, 31]) == [False, False, False]
    assert sw.update(31) is True  # third consecutive step below 32
    assert sw.flips == 1


def test_one_small_batch_between_large_ones_resets_the_streak() -> None:
    sw = SdSwitch(SwitchConfig(on_below=32, patience=3))
    # 32 is not < 32: it breaks the streak, so two runs of two small steps never switch on
    assert not any(feed(sw, [31, 31, 32, 31, 31, 40, 10, 10]))
    assert sw.update(10) is True


def test_turns_off_only_after_patience_steps_at_or_above_off_at() -> None:
    sw = SdSwitch(SwitchConfig(on_below=8, patience=2, off_at=12))
    feed(sw, [4, 4])
    assert sw.on
    # between on_below and off_at: stays on however long
    assert all(feed(sw, [8, 11, 11, 11, 11, 11]))
    assert feed(sw, [12, 5, 12]) == [True, True, True]  # 5 interrupts the off streak
    assert sw.update(12) is False
    assert sw.flips == 2


def test_no_flapping_around_the_threshold() -> None:
    rng = random.Random(0)
    sw = SdSwitch(SwitchConfig(on_below=32, patience=3))
    # a noisy batch hovering around on_below (e.g. sequences finishing while others join)
    states = feed(sw, [32 + rng.randint(-4, 4) for _ in range(2000)])
    assert sw.flips <= 1
    # and a batch hovering around the off threshold once on never turns it off and on again repeatedly
    sw2 = SdSwitch(SwitchConfig(on_below=32, patience=3))
    feed(sw2, [1, 1, 1])
    flips_before = sw2.flips
    feed(sw2, [48 + rng.choice([-1, 0]) for _ in range(2000)])
    assert sw2.flips - flips_before <= 1
    assert sum(a != b for a, b in zip(states, states[1:], strict=False)) <= 1  # the returned states agree


def test_without_hysteresis_gap_a_naive_threshold_would_flap() -> None:
    # the same input through patience 1 and a minimal gap flips many times: the test above is not vacuous
    rng = random.Random(0)
    naive = SdSwitch(SwitchConfig(on_below=32, patience=1, off_at=33))
    feed(naive, [32 + rng.randint(-4, 4) for _ in range(2000)])
    assert naive.flips > 100


def test_pinned_modes_and_validation() -> None:
    on, off = SdSwitch(SwitchConfig(mode="on")), SdSwitch(SwitchConfig(mode="off"))
    assert all(feed(on, [512, 512, 512, 1])) and not any(feed(off, [1, 1, 1, 1]))
    with pytest.raises(ValueError):
        SwitchConfig(on_below=32, off_at=32)
    with pytest.raises(ValueError):
        SwitchConfig(patience=0)


def test_state_round_trip_and_reset() -> None:
    sw = SdSwitch(SwitchConfig(patience=3))
    feed(sw, [1, 1])
    clone = SdSwitch(sw.config)
    clone.load_dict(sw.to_dict())
    assert clone.update(1) is sw.update(1) is True
    sw.reset()
    assert not sw.on and sw.flips == 0


def test_from_rollout_config() -> None:
    from worker.tlt.config import RolloutConfig

    cfg = SwitchConfig.from_rollout(RolloutConfig(sd_on_below=8, sd_patience=2))
    assert (cfg.mode, cfg.on_below, cfg.patience, cfg.off_threshold) == ("adaptive", 8, 2, 12)
