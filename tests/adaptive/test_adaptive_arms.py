"""Arms, presets and the bucket scheme. Run: `python -m pytest tests/adaptive/test_adaptive_arms.py -q`."""

from __future__ import annotations

import pytest

from worker.tlt.speculative.arm import NO_SD, Arm
from worker.tlt.speculative.control.arm_buckets import ARM_PRESETS, TLT_BUCKETS, BucketScheme, arms_table, default_arms


def test_tlt_buckets_and_budgets() -> None:
    s = TLT_BUCKETS
    assert [s.bucket(a) for a in (1, 2, 4, 5, 20, 21, 512)] == [0, 1, 1, 2, 2, 3, 3]
    assert [s.label(b) for b in range(4)] == ["1", "2-4", "5-20", "ge21"]
    assert [s.verify_budget(b) for b in range(4)] == [48, 32, 16, 8]
    with pytest.raises(ValueError):
        BucketScheme(upper=(4, 2), verify_budgets=(1, 2, 3))
    with pytest.raises(ValueError):
        BucketScheme(upper=(4,), verify_budgets=(8,))


@pytest.mark.parametrize("drafters", [(), ("ngram",), ("ngram", "eagle"), ("eagle", "small", "eagle")])
def test_default_arms_always_include_no_sd_and_respect_the_budget(drafters: tuple) -> None:
    for b in range(TLT_BUCKETS.num_buckets):
        arms = default_arms(b, drafters)
        assert arms[0] == NO_SD
        assert len({a.name for a in arms}) == len(arms)
        assert {a.drafter for a in arms} == {"none", *drafters}
        for a in arms:
            assert a.verify_tokens <= TLT_BUCKETS.verify_budget(b)
            if a.drafter == "ngram":
                assert a.chain
        trees = [a for a in arms if not a.chain]
        assert all(t.verify_tokens == TLT_BUCKETS.verify_budget(b) for t in trees)
        assert bool(trees) == any(d in ("eagle", "small") for d in drafters)


def test_arms_table_covers_every_bucket() -> None:
    table = arms_table(["ngram"])
    assert sorted(table) == [0, 1, 2, 3]
    assert [a.name for a in table[0]] == ["none", "ngram-c3", "ngram-c6"]


def test_arm_validation_and_shape() -> None:
    chain = ARM_PRESETS["eagle-c6"]
    assert chain.chain and chain.is_sd and chain.verify_tokens == 7 and chain.num_drafted == 6
    assert NO_SD.verify_tokens == 1 and NO_SD.num_drafted == 0 and not NO_SD.is_sd
    assert Arm.from_dict(chain.to_dict()) == chain
    with pytest.raises(ValueError):
        Arm("x", "eagle", depth=4, topk=1, verify_tokens=4)  # a chain verifies its depth + the root
    with pytest.raises(ValueError):
        Arm("x", "eagle", depth=2, topk=2, verify_tokens=8)  # a 2x2 tree has 6 nodes + the root
    with pytest.raises(ValueError):
        Arm("x", "none", depth=0, topk=1, verify_tokens=0)
    assert Arm("t", "eagle", depth=2, topk=2, verify_tokens=7).num_drafted == 6
    with pytest.raises(ValueError):
        Arm("x", "medusa", depth=3, topk=1, verify_tokens=3)  # type: ignore[arg-type]


def test_verify_lengths_per_bucket() -> None:
    from worker.tlt.speculative.control.arm_buckets import verify_lengths

    lengths = verify_lengths(arms_table(["ngram", "eagle"]))
    assert lengths[0] == (1, 4, 7, 48) and lengths[3] == (1, 4, 7, 8)
