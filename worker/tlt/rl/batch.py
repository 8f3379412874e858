"""Update batches: prompt + response sequences padded into tensors, split into micro-batches by a token budget.

    mbs = micro_batches(seqs, token_budget=16384, pad_id=tok.pad_id, device="cuda")
    for mb in mbs:  mb.input_ids [b, S], mb.mask [b, S-1] marks the positions whose next token is a response token

A micro-batch's cost is counted as padded tokens (rows x longest row). Sequences are sorted by length (longest
first, ties by position) and cut into consecutive groups within the budget (`plan_micro_batches`), so each
micro-batch holds rows of similar length: packed in arrival order, one max-length response pads its whole
micro-batch to that length. On a long-tailed GRPO batch (64 responses, p50 326, p90 1024; test_train_microbatch.py)
padded / real tokens fall from 2.0 in order to 1.11 sorted, in the same 5 micro-batches of 16384. The plan depends
only on the lengths and their positions, so it is the same on every run and after a resume; the loss is the full
batch's either way (rl/algorithms/base.py LossNorm), micro-batching only changes float summation order. A single
sequence longer than the budget gets a micro-batch of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class UpdateSeq:
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    advantage: float
    rollout_logprobs: Sequence[float] | None  # the engine's log-probs of the response tokens, if it gave them

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor  # [b, S] prompt + response, right-padded
    targets: torch.Tensor  # [b, S-1] input_ids shifted left: the token each position predicts
    mask: torch.Tensor  # [b, S-1] float; 1 where the target is a response token
    resp_index: torch.Tensor  # [n] long: the mask's ones as row-major positions in the flattened [b * (S-1)] grid
    advantages: torch.Tensor  # [b]
    rollout_logp: torch.Tensor | None  # [b, S-1] engine log-probs aligned with targets (0 off-mask); None if absent


def pack(seqs: Sequence[UpdateSeq], pad_id: int, device: torch.device | str) -> MicroBatch:
    s = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), s), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), s - 1)
    have_lp = all(x.rollout_logprobs is not None for x in seqs)
    rlp = torch.zeros(len(seqs), s - 1) if have_lp else None
    for i, x in enumerate(seqs):
        p, r = len(x.prompt_ids), len(x.response_ids)
        ids[i, :p] = torch.tensor(list(x.prompt_ids), dtype=torch.long)
        if r:
            ids[i, p : p + r] = torch.tensor(list(x.response_ids), dtype=torch.long)
            mask[i, p - 1 : p - 1 + r] = 1.0  # position j predicts token j+1
            if rlp is not None and x.rollout_logprobs is not None:
                rlp[i, p - 1 : p - 1 + r] = torch.tensor(list(x.rollout_logprobs), dtype=torch.float32)
    # found here on the host: a boolean-mask select on the device would wait for the GPU to learn its size
    resp_index = mask.reshape(-1).nonzero().squeeze(1)
    adv = torch.tensor([x.advantage for x in seqs], dtype=torch.float32)
    ids = ids.to(device)
    return MicroBatch(
        input_ids=ids,
        targets=ids[:, 1:],
        mask=mask.to(device),
        resp_index=resp_index.to(device),
        advantages=adv.to(device),
        rollout_logp=rlp.to(device) if rlp is not None else None,
    )


def consecutive_groups(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Positions 0..n-1 cut into consecutive groups whose padded size (rows x longest) stays within token_budget."""
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        new_longest = max(longest, n)
        if cur and new_longest * (len(cur) + 1) > token_budget:
            groups.append(cur)
            cur, new_longest = [], n
        cur.append(i)
        longest = new_longest
    if cur:
        groups.append(cur)
    return groups


def split_by_budget(seqs: Sequence[UpdateSeq], token_budget: int) -> list[list[UpdateSeq]]:
    """Consecutive groups (in the given order) whose padded size stays within token_budget."""
    return [[seqs[i] for i in g] for g in consecutive_groups([len(x) for x in seqs], token_budget)]


def length_order(lengths: Sequence[int]) -> list[int]:
    """Positions by decreasing length, ties by position: a function of the lengths and positions alone."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def plan_micro_batches(lengths: Sequence[int], token_budget: int, overhead_tokens: int | None = None) -> list[list[int]]:
    """Positions of each micro-batch: sorted longest first, then cut into consecutive groups within the padded
    budget, choosing the cuts that minimise padded tokens + overhead_tokens per micro-batch (exact, by dynamic
    programming over the sorted order; ties go to the earliest cut). overhead_tokens prices a micro-batch's fixed
    cost (its kernel launches, smaller matmuls) in tokens; default token_budget // 8. 0 would give every distinct
    length its own micro-batch, a huge value the fewest micro-batches."""
    overhead = token_budget // 8 if overhead_tokens is None else overhead_tokens
    order = length_order(lengths)
    srt = [lengths[i] for i in order]  # non-increasing: a group's first row is its longest
    n = len(srt)
    best = [0] + [-1] * n  # best[j]: cost of the first j sorted rows; -1 = not reached yet
    cut = [0] * (n + 1)  # cut[j]: where the last group of that best plan starts
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):  # group = sorted rows i..j-1, longest srt[i]
            rows = j - i
            if rows > 1 and rows * srt[i] > token_budget:
                break  # a longer group (smaller i) only gets longer rows: over budget too
            cost = best[i] + rows * srt[i] + overhead
            if best[j] < 0 or cost <= best[j]:
                best[j], cut[j] = cost, i
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append([order[k] for k in range(cut[j], j)])
        j = cut[j]
    return groups[::-1]


def padded_tokens(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> int:
    """Tokens the micro-batches `groups` (positions into lengths) cost once padded: sum of rows x longest row."""
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


def micro_batches(
    seqs: Sequence[UpdateSeq], token_budget: int, pad_id: int, device: torch.device | str
) -> list[MicroBatch]:
    # all packed (and copied to the device) before the first forward: the copies then wait on an idle GPU
    return [pack([seqs[i] for i in g], pad_id, device) for g in plan_micro_batches([len(x) for x in seqs], token_budget)]
