"""Speculative-decoding strategies ("arms") and the batch-size buckets the bandit chooses them in.

An `Arm` is one way to run a decode step: which drafter proposes, how deep, how wide (top-k per node; 1 = chain),
and how many tokens per sequence the target verifies in one forward. The arm named "none" (drafter "none") is plain
decoding; `default_arms()` always includes it, so a bandit can always fall back to it and adaptive SD can never be
slower than SD off by more than its exploration cost.

`BucketScheme` maps the active batch size to a bucket (TLT's default: 1 / 2-4 / 5-20 / >=21; `ONE_GPU_BUCKETS`, the
job spec's default, splits at the engine's graph batch buckets 1 / 2 / 3-4 / ... / 129-256 / >=257) with a verify budget
per bucket (TLT: 48 / 32 / 16 / 8): a small batch leaves the GPU memory-bound, so it can verify many tokens per sequence
for the price of one; a large batch is near compute-bound and can afford few.

Convention (as SGLang's `speculative_num_draft_tokens` and
the N of decoding/draft_types.py's `DraftProposal`): `verify_tokens` is the width of the target's verify forward per
sequence, root included, i.e. the verify length of a CUDA graph. A chain of depth k verifies k + 1; plain decoding 1.

Run the tests: `python -m pytest tests/adaptive -q`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal, get_args

DrafterKind = Literal["ngram", "eagle", "small", "none"]
DRAFTER_KINDS: tuple[str, ...] = get_args(DrafterKind)


@dataclass(frozen=True)
class Arm:
    name: str  # unique, stable key (bandit state and the sd/arm/<name> metric use it)
    drafter: DrafterKind  # "ngram": model-free suffix matcher; "eagle": learned head; "small": a small draft LM
    depth: int  # draft depth (chain length / tree depth); 0 for "none"
    topk: int  # children per node; 1 = chain, > 1 = tree
    verify_tokens: int  # positions per sequence in the verify forward, root included; chain: depth + 1; "none": 1

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTER_KINDS:
            raise ValueError(f"unknown drafter {self.drafter!r}; known: {DRAFTER_KINDS}")
        if not self.name:
            raise ValueError("an arm needs a name")
        if self.drafter == "none":
            if (self.depth, self.topk, self.verify_tokens) != (0, 1, 1):
                raise ValueError("the no-SD arm has depth 0, topk 1, verify_tokens 1")
            return
        if self.depth < 1 or self.topk < 1:
            raise ValueError(f"arm {self.name}: depth and topk must be >= 1")
        if self.topk == 1 and self.verify_tokens != self.depth + 1:
            raise ValueError(f"chain arm {self.name}: verify_tokens must be depth + 1")
        capacity = tree_capacity(self.depth, self.topk)
        if not self.depth + 1 <= self.verify_tokens <= capacity:
            raise ValueError(f"tree arm {self.name}: verify_tokens must be in [depth + 1, {capacity}]")

    @property
    def is_sd(self) -> bool:
        return self.drafter != "none"

    @property
    def chain(self) -> bool:
        return self.topk == 1

    @property
    def num_drafted(self) -> int:
        """Drafted tokens per sequence (verify width minus the root); 0 for plain decoding."""
        return self.verify_tokens - 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Arm:
        return cls(**d)


def tree_capacity(depth: int, topk: int) -> int:
    """Largest verify width of a tree of this shape: the root plus topk^1 + ... + topk^depth nodes."""
    return 1 + sum(topk**d for d in range(1, depth + 1))


NO_SD = Arm("none", "none", depth=0, topk=1, verify_tokens=1)


def chain_arm(drafter: DrafterKind, depth: int) -> Arm:
    return Arm(f"{drafter}-c{depth}", drafter, depth=depth, topk=1, verify_tokens=depth + 1)


def tree_arm(drafter: DrafterKind, depth: int, topk: int, verify_tokens: int) -> Arm:
    return Arm(f"{drafter}-d{depth}k{topk}v{verify_tokens}", drafter, depth=depth, topk=topk, verify_tokens=verify_tokens)


def fixed_arm(drafter: DrafterKind, depth: int, topk: int = 1, verify_tokens: int = 0) -> Arm:
    """One SD arm of this shape: a chain of `depth` tokens (topk 1), else a top-k tree whose verify width is
    `verify_tokens` brought into [depth + 1, the tree's capacity]."""
    if topk == 1:
        return chain_arm(drafter, depth)
    return tree_arm(drafter, depth, topk, min(max(verify_tokens, depth + 1), tree_capacity(depth, topk)))


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
