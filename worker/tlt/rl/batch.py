"""Update batches: prompt + response sequences padded into tensors, split into micro-batches by a token budget.

    mbs = micro_batches(seqs, token_budget=16384, pad_id=tok.pad_id)
    for mb in mbs:  mb.input_ids [b, S], mb.mask [b, S-1] marks the positions whose next token is a response token

A micro-batch's cost is counted as padded tokens (rows x longest row); sequences are packed in order (so results do
not depend on lengths sorting differently between runs) and a single sequence longer than the budget gets a
micro-batch of its own.
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
    adv = torch.tensor([x.advantage for x in seqs], dtype=torch.float32)
    ids = ids.to(device)
    return MicroBatch(
        input_ids=ids,
        targets=ids[:, 1:],
        mask=mask.to(device),
        advantages=adv.to(device),
        rollout_logp=rlp.to(device) if rlp is not None else None,
    )


def split_by_budget(seqs: Sequence[UpdateSeq], token_budget: int) -> list[list[UpdateSeq]]:
    """Consecutive groups whose padded size (rows x longest) stays within token_budget."""
    groups: list[list[UpdateSeq]] = []
    cur: list[UpdateSeq] = []
    longest = 0
    for x in seqs:
        new_longest = max(longest, len(x))
        if cur and new_longest * (len(cur) + 1) > token_budget:
            groups.append(cur)
            cur, new_longest = [], len(x)
        cur.append(x)
        longest = new_longest
    if cur:
        groups.append(cur)
    return groups


def micro_batches(
    seqs: Sequence[UpdateSeq], token_budget: int, pad_id: int, device: torch.device | str
) -> list[MicroBatch]:
    return [pack(g, pad_id, device) for g in split_by_budget(seqs, token_budget)]
