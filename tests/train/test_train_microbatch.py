"""Length-aware micro-batching and the chunked log-prob/entropy of the update:
- on a long-tailed GRPO batch (64 responses, p50 326, p90 1024, mean ~440, prompts 100-200 tokens) sorting by length
  cuts the padded tokens from 2.0x the real ones (packed in order) to 1.11x, in no more micro-batches;
- the plan depends only on the lengths, covers every sequence once, respects the budget;
- an update over sorted micro-batches equals the in-order and the single-batch update up to float summation order;
- the chunked log-prob/entropy (values and gradient) equals the plain fp32 log-softmax.

Run: python -m pytest tests/train/test_train_microbatch.py -q
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import NormalDist
from typing import Any

import pytest
import torch

from worker.tlt.build import build_trainer
from worker.tlt.file_reporter import FileReporter
from worker.tlt.rl import batch, logprobs
from worker.tlt.rl import trainer as trainer_mod
from worker.tlt.rl.batch import UpdateSeq, consecutive_groups, pack, padded_tokens, plan_micro_batches, split_by_budget


def long_tail_lengths(n_groups: int = 8, group: int = 8, cap: int = 1024) -> list[int]:
    """Deterministic prompt + response lengths shaped like a SmolLM2 GSM8K step: one eighth of the responses hit
    the cap, the rest follow log-normal quantiles (median 286, sigma 0.72), giving p50 ~326 and mean ~440; prompts
    100..200 tokens per group; responses in a fixed shuffled order (the engine returns groups, not lengths)."""
    n = n_groups * group
    n_cap = n // 8
    short = [min(cap - 1, round(286 * math.exp(0.72 * NormalDist().inv_cdf((i + 0.5) / (n - n_cap)))))
             for i in range(n - n_cap)]
    responses = short + [cap] * n_cap
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    return [100 + (i // group) * 100 // (n_groups - 1) + responses[perm[i]] for i in range(n)]


def padding_report(lengths: list[int], token_budget: int) -> dict[str, float]:
    """Padded / real tokens and micro-batch counts, packed in order vs the length-aware plan."""
    real = sum(lengths)
    in_order, planned = consecutive_groups(lengths, token_budget), plan_micro_batches(lengths, token_budget)
    return {
        "in_order_ratio": padded_tokens(lengths, in_order) / real,
        "in_order_mbs": len(in_order),
        "sorted_ratio": padded_tokens(lengths, planned) / real,
        "sorted_mbs": len(planned),
    }


def test_sorting_cuts_the_padding_of_a_long_tailed_batch() -> None:
    lengths = long_tail_lengths()
    resp = sorted(x - 100 - (i // 8) * 100 // 7 for i, x in enumerate(lengths))
    assert abs(sum(resp) / 64 - 440) < 5 and resp[31] <= 326 <= resp[32] and resp[57] == 1024
    r = padding_report(lengths, 16384)
    assert r["in_order_ratio"] > 1.8 and r["in_order_mbs"] == 5  # one capped row pads its whole micro-batch
    assert r["sorted_ratio"] < 1.15 and r["sorted_mbs"] <= r["in_order_mbs"]  # 1.11x, 5 micro-batches
    # even the fewest-micro-batches plan (overhead priced out of reach) beats in-order packing
    fewest = plan_micro_batches(lengths, 16384, overhead_tokens=10**9)
    assert len(fewest) == 3 and padded_tokens(lengths, fewest) / sum(lengths) < 1.3


@pytest.mark.parametrize("seed", range(5))
def test_plan_covers_each_sequence_once_within_budget(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (40,), generator=g).tolist()
    budget = 120
    plan = plan_micro_batches(lengths, budget)
    assert sorted(i for grp in plan for i in grp) == list(range(40))
    assert all(len(grp) == 1 or len(grp) * max(lengths[i] for i in grp) <= budget for grp in plan)
    assert plan == plan_micro_batches(list(lengths), budget)  # a function of the lengths alone
    flat = [lengths[i] for grp in plan for i in grp]
    assert flat == sorted(flat, reverse=True)  # longest first, rows of similar length together
    # exact: never costlier than the greedy cut of the same sorted order, under the same price per micro-batch
    order = batch.length_order(lengths)
    greedy = [[order[k] for k in grp] for grp in consecutive_groups([lengths[i] for i in order], budget)]
    price = budget // 8
    assert padded_tokens(lengths, plan) + price * len(plan) <= padded_tokens(lengths, greedy) + price * len(greedy)


def test_ties_keep_positions_and_oversize_rows_stand_alone() -> None:
    assert batch.length_order([3, 5, 3, 5]) == [1, 3, 0, 2]
    plan = plan_micro_batches([4, 30, 4, 4], token_budget=12, overhead_tokens=100)
    assert plan == [[1], [0, 2, 3]]


def test_pack_lists_response_positions_in_mask_order() -> None:
    seqs = [UpdateSeq([1, 2, 3], [7, 8], 0.5, None), UpdateSeq([4], [9, 10, 11], -1.0, None)]
    mb = pack(seqs, pad_id=0, device="cpu")
    assert mb.resp_index.tolist() == mb.mask.reshape(-1).nonzero().squeeze(1).tolist() == [2, 3, 4, 5, 6]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_match_the_plain_softmax(monkeypatch: pytest.MonkeyPatch,
                                                              temperature: float) -> None:
    g = torch.Generator().manual_seed(1)
    n, v = 10, 17
    monkeypatch.setattr(logprobs, "VOCAB_CHUNK_ELEMENTS", 3 * v)  # chunks of 3 rows: 4 chunks, the last partial
    base = torch.randn(n, v, generator=g) * 3
    targets = torch.randint(0, v, (n,), generator=g)
    w = torch.randn(n, generator=g)
    x1, x2 = base.clone().requires_grad_(), base.clone().requires_grad_()
    lp, ent = logprobs.token_logprobs_entropy(x1, targets, temperature)
    want_lp = logprobs.token_logprobs(x2[None], targets[None], temperature)[0]
    want_ent = logprobs.token_entropy(base[None], temperature)[0]
    torch.testing.assert_close(lp, want_lp)
    torch.testing.assert_close(ent, want_ent)
    assert not ent.requires_grad
    (lp * w).sum().backward()
    (want_lp * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    # bf16 logits get a bf16 gradient (the head's dtype), from fp32 math
    xb = base.bfloat16().requires_grad_()
    lpb, _ = logprobs.token_logprobs_entropy(xb, targets, temperature)
    lpb.sum().backward()
    assert lpb.dtype == torch.float32 and xb.grad is not None and xb.grad.dtype == torch.bfloat16


def _update(loss_type: str, budget: int, plan: Any, toy_spec: Any, run_dir: Path) -> tuple[dict[str, torch.Tensor],
                                                                                          dict]:
    """Gradients the optimizer saw and the metrics of one update of a fixed ragged batch, micro-batched by `plan`."""
    spec = toy_spec({"loss_type": loss_type, "micro_batch_tokens": budget, "max_grad_norm": 1e6})
    tr, _ = build_trainer(spec, FileReporter(run_dir))
    g = torch.Generator().manual_seed(3)
    seqs = [UpdateSeq(torch.randint(3, 200, (4 + i % 3,), generator=g).tolist(),
                      torch.randint(3, 200, (1 + (7 * i) % 13,), generator=g).tolist(), float(i % 3) - 1.0,
                      (-torch.rand(1 + (7 * i) % 13, generator=g)).tolist())
            for i in range(9)]
    grads: dict[str, torch.Tensor] = {}
    names = {id(p): k for k, p in tr.model.named_parameters()}

    def grab(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads.update({names[id(p)]: p.grad.detach().clone() for p in tr.master.train_params if p.grad is not None})

    tr.optimizer.register_step_pre_hook(grab)
    original = trainer_mod.micro_batches
    trainer_mod.micro_batches = plan  # type: ignore[assignment]
    try:
        metrics = tr.update(seqs)
    finally:
        trainer_mod.micro_batches = original
        tr.close()
    return grads, metrics


def _in_order(seqs: list[UpdateSeq], token_budget: int, pad_id: int, device: Any) -> list[batch.MicroBatch]:
    return [pack(grp, pad_id, device) for grp in split_by_budget(seqs, token_budget)]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_sorted_micro_batches_give_the_full_batch_update(loss_type: str, toy_spec: Any, tmp_path: Path) -> None:
    sorted_mb = _update(loss_type, 64, batch.micro_batches, toy_spec, tmp_path)
    in_order = _update(loss_type, 64, _in_order, toy_spec, tmp_path)
    whole = _update(loss_type, 10**6, batch.micro_batches, toy_spec, tmp_path)
    assert len(batch.plan_micro_batches([9] * 9, 64)) > 1  # the small budget really splits the batch
    for grads, metrics in (in_order, whole):
        assert grads.keys() == sorted_mb[0].keys() and grads
        for k in grads:
            torch.testing.assert_close(sorted_mb[0][k], grads[k], rtol=1e-5, atol=1e-7, msg=k)
        assert metrics.keys() == sorted_mb[1].keys()
        for k, v in metrics.items():
            assert sorted_mb[1][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
