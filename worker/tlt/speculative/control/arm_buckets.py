"""The arms a controller chooses among, and the batch-size buckets the bandit chooses them in.

The arm type (`Arm`, `NO_SD`, `chain_arm` / `tree_arm` / `fixed_arm`) is speculative/arm.py's, below the engine that
runs it. Here: the named presets, and `default_arms()`, which always includes `NO_SD`, so a bandit can always fall
back to plain decoding and adaptive SD can never be slower than SD off by more than its exploration cost.

`BucketScheme` maps the active batch size to a bucket (TLT's default: 1 / 2-4 / 5-20 / >=21; `ONE_GPU_BUCKETS`, the
job spec's default, splits at the engine's graph batch buckets 1 / 2 / 3-4 / ... / 129-256 / >=257) with a verify budget
per bucket (TLT: 48 / 32 / 16 / 8): a small batch leaves the GPU memory-bound, so it can verify many tokens per sequence
for the price of one; a large batch is near compute-bound and can afford few.

Run the tests: `python -m pytest tests/adaptive -q`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from worker.tlt.speculative.arm import NO_SD, Arm, DrafterKind, chain_arm, tree_arm, tree_capacity

# Named presets (benchmarks and job specs can pin one arm by name).
ARM_PRESETS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        NO_SD,
        chain_arm("ngram", 3),
        chain_arm("ngram", 6),
        chain_arm("eagle", 3),
        chain_arm("eagle", 6),
        tree_arm("eagle", 6, 4, 32),  # EAGLE-2-like tree at a small batch
        tree_arm("eagle", 6, 8, 48),  # TLT's widest budget (batch 1)
    )
}


@dataclass(frozen=True)
class BucketScheme:
    upper: tuple[int, ...] = (1, 4, 20)  # inclusive upper bound of each bucket but the last (TLT: 1 / 2-4 / 5-20 / >=21)
    verify_budgets: tuple[int, ...] = (48, 32, 16, 8)  # verify width per sequence allowed in each bucket (TLT)

    def __post_init__(self) -> None:
        if len(self.verify_budgets) != len(self.upper) + 1:
            raise ValueError("need one verify budget per bucket (len(upper) + 1)")
        if list(self.upper) != sorted(set(self.upper)) or (self.upper and self.upper[0] < 1):
            raise ValueError("bucket bounds must be strictly increasing and >= 1")

    @property
    def num_buckets(self) -> int:
        return len(self.verify_budgets)

    def bucket(self, active: int) -> int:
        """Bucket index of an active batch size (>= 1)."""
        for i, hi in enumerate(self.upper):
            if active <= hi:
                return i
        return len(self.upper)

    def label(self, bucket: int) -> str:
        """Metric-safe label: "1", "2-4", "5-20", "ge21"."""
        lo = 1 if bucket == 0 else self.upper[bucket - 1] + 1
        if bucket == len(self.upper):
            return f"ge{lo}"
        hi = self.upper[bucket]
        return str(lo) if lo == hi else f"{lo}-{hi}"

    def verify_budget(self, bucket: int) -> int:
        return self.verify_budgets[bucket]


TLT_BUCKETS = BucketScheme()
# One GPU (the default of `AdaptiveSd.from_spec`): bounds on the engine's CUDA-graph batch buckets (1, 2, 4, ... 64),
# so a (bucket, verify width) pair is one verify graph, and TLT's single ">= 21" bucket is split where the cost of
# a verify changes: 17-32, 33-64 and >= 65 no longer share one bandit whose rewards mix 4x different batches.
ONE_GPU_BUCKETS = BucketScheme(upper=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                               verify_budgets=(48, 32, 24, 16, 12, 8, 8, 4, 4, 4))

# Arm shapes default_arms() draws from; each is kept only if it fits the bucket's verify budget.
CHAIN_DEPTHS: tuple[int, ...] = (3, 6)  # short chain for weak drafts, longer for strong ones
NGRAM_CHAIN_DEPTHS: tuple[int, ...] = (3, 6)  # the n-gram drafter copies runs, so the same depths
TREE_SHAPES: tuple[tuple[int, int], ...] = ((6, 4),)  # (depth, topk) of learned-drafter trees, verify = bucket budget


def default_arms(bucket: int, drafters_available: Iterable[DrafterKind],
                 scheme: BucketScheme = TLT_BUCKETS) -> tuple[Arm, ...]:
    """The arms of a bucket: "none" first, then chains per available drafter, then trees for learned drafters.

    N-gram proposals are deterministic copies of one continuation, so that drafter gets chains only; learned
    drafters ("eagle", "small") also get trees whose verify width equals the bucket's budget.
    """
    budget = scheme.verify_budget(bucket)
    arms: list[Arm] = [NO_SD]
    for kind in dict.fromkeys(drafters_available):  # de-duplicated, order kept
        if kind == "none":
            continue
        depths = NGRAM_CHAIN_DEPTHS if kind == "ngram" else CHAIN_DEPTHS
        arms += [chain_arm(kind, d) for d in depths if d + 1 <= budget]
        if kind != "ngram":
            for depth, topk in TREE_SHAPES:
                if depth + 1 < budget <= tree_capacity(depth, topk):
                    arms.append(tree_arm(kind, depth, topk, budget))
    return tuple(arms)


def arms_table(drafters_available: Sequence[DrafterKind],
               scheme: BucketScheme = TLT_BUCKETS) -> dict[int, tuple[Arm, ...]]:
    """`default_arms` for every bucket of the scheme (the bandit's constructor argument)."""
    return {b: default_arms(b, drafters_available, scheme) for b in range(scheme.num_buckets)}


def verify_lengths(table: dict[int, Sequence[Arm]]) -> dict[int, tuple[int, ...]]:
    """Per bucket, the distinct verify widths its arms need: the (batch bucket, verify length) pairs for which the
    engine captures CUDA graphs."""
    return {b: tuple(sorted({a.verify_tokens for a in arms})) for b, arms in table.items()}
