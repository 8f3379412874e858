"""What an "arm" is: one way to run a decode step, the shape the engine drafts and verifies with.

An `Arm` names which drafter proposes, how deep, how wide (top-k per node; 1 = chain), and how many tokens per
sequence the target verifies in one forward. `NO_SD` (drafter "none") is plain decoding. Convention (as SGLang's
`speculative_num_draft_tokens` and the N of draft_types.py's `DraftProposal`): `verify_tokens` is the width of the
target's verify forward per sequence, root included, i.e. the verify length of a CUDA graph. A chain of depth k
verifies k + 1; plain decoding 1.

The type lives in the bottom layer because the engine runs arms and the controllers above it choose them; which
arms a controller chooses among (presets, batch buckets, verify budgets) is speculative/control/arm_buckets.py's.

Run the tests: `python -m pytest tests/adaptive/test_adaptive_arms.py -q`.
"""

from __future__ import annotations

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
    def drafts_with_q(self) -> bool:
        """Whether its drafts come with the drafter's distribution q for the verifier (sampled rows): a learned
        drafter's chain. Trees and n-gram drafts are deterministic (draft_probs None), which the verify graph of
        their shape is captured without."""
        return self.drafter in ("eagle", "small") and self.topk == 1

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
