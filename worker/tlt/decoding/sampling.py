"""The processed sampling distribution, shared by plain decoding and by the speculative verifier.

Speculative sampling is lossless only with respect to *one* distribution; this module defines it. Plain decoding
samples `sample(processed_probs(logits, ...))`; the verifier (speculative/verify/verifier.py) accepts drafts against exactly the same
`processed_probs`. Processing order, per row (as HF / vLLM): temperature, then top-k, then top-p.

- temperature 0 means greedy: a one-hot at `argmax(logits)` (first index on ties, like `torch.argmax`);
- top_k <= 0 or >= V is off; ties at the k-th logit are all kept (a threshold, so the result is order-free);
- top_p >= 1 is off; otherwise the smallest set of most-likely tokens whose mass reaches top_p is kept (the most
  likely token always survives).

Parameters are floats (one setting for the batch) or tensors [B] (one per row, so a batch mixes settings); logits may
carry extra dims between B and V ([B, N, V] for the verifier's N tree nodes), the per-row params broadcast over them.

Run the tests: `python -m pytest tests/spec/test_spec_sampling.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

Param = float | int | torch.Tensor


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings of an active batch (tensors [B] on the logits' device)."""

    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_p: torch.Tensor  # [B] float in (0, 1]; 1 = off
    top_k: torch.Tensor  # [B] int64; 0 = off

    @staticmethod
    def uniform(
        batch: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, device: torch.device | str = "cpu"
    ) -> RowSampling:
        """The same setting for every row."""
        return RowSampling(
            temperature=torch.full((batch,), float(temperature), device=device),
            top_p=torch.full((batch,), float(top_p), device=device),
            top_k=torch.full((batch,), int(top_k), dtype=torch.int64, device=device),
        )

    def select(self, rows: torch.Tensor) -> RowSampling:
        """The settings of a subset of rows (`rows` [B'] int64 indices), e.g. after sequences leave the batch."""
        return RowSampling(self.temperature[rows], self.top_p[rows], self.top_k[rows])

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [B, ..., V] -> [B, ..., V]
        return processed_probs(logits, self.temperature, self.top_p, self.top_k)


class DraftFilters(NamedTuple):
    """What the host knows of a batch's RowSampling, for drafters that sample (DraftContext.filters; a key of the
    drafters' captured graphs). A drafter skips a filter no row uses and takes one k and one T as numbers (torch.topk;
    no per-row temperature and greedy handling), so per-row work runs only where settings differ."""

    top_k: int = -1  # 0: no row filters by top-k; > 0: the rows' common k; -1: rows differ
    top_p: bool = True  # some row filters by top-p
    temperature: float = -1.0  # the rows' common temperature when it is > 0; -1: rows differ, or greedy rows


def _per_row(value: Param, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A scalar or a [B] tensor, shaped [B, 1, ..., 1] to broadcast against `logits` [B, ..., V]. A Python scalar is
    filled on the device (no host-to-device copy: this runs inside CUDA-graph captures)."""
    if not isinstance(value, torch.Tensor):
        return torch.full((logits.shape[0],) + (1,) * (logits.dim() - 1), value, dtype=dtype, device=logits.device)
    t = value.to(dtype=dtype, device=logits.device)
    if t.dim() == 0:
        t = t.expand(logits.shape[0])
    if t.shape != (logits.shape[0],):
        raise ValueError(f"per-row parameter has shape {tuple(t.shape)}, expected ({logits.shape[0]},)")
    return t.reshape((-1,) + (1,) * (logits.dim() - 1))


def processed_probs(
    logits: torch.Tensor,  # [B, ..., V] raw target (or drafter) logits
    temperature: Param = 1.0,  # float or [B]; 0 = greedy one-hot
    top_p: Param = 1.0,  # float or [B]; 1 = off
    top_k: Param = 0,  # int or [B]; 0 = off
) -> torch.Tensor:  # [B, ..., V] float32 probabilities, each row sums to 1
    """The distribution both plain decoding and the verifier sample from (see the module docstring)."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy: torch.Tensor | None = None  # [B, 1, ..., 1] rows with temperature 0 (None: one positive temperature)
    if not isinstance(temperature, torch.Tensor) and float(temperature) > 0.0:
        scaled = logits / float(temperature)
    else:
        temp = _per_row(temperature, logits, torch.float32)
        greedy = temp <= 0.0
        scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)

    # A Python scalar that switches a filter off skips it; a tensor is always applied (no host sync to check it).
    use_k = isinstance(top_k, torch.Tensor) or 0 < int(top_k) < vocab
    use_p = isinstance(top_p, torch.Tensor) or float(top_p) < 1.0
    if not (use_k or use_p):
        probs = torch.softmax(scaled, dim=-1)
    elif use_k and not use_p and not isinstance(top_k, torch.Tensor):
        # One k for the batch: topk finds the k-th largest without sorting the vocabulary (same ties rule as below:
        # every logit >= the k-th largest survives).
        kth = torch.topk(scaled, int(top_k), dim=-1).values[..., -1:]  # [B, ..., 1]
        probs = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
    else:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        if use_k:
            k = _per_row(top_k, logits, torch.int64)
            k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
            kth = sorted_logits.gather(-1, (k - 1).expand(*scaled.shape[:-1], 1))  # [B, ..., 1] k-th largest
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        if use_p:
            p = _per_row(top_p, logits, torch.float32)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly more likely tokens
            # the most likely token has mass_before 0 < p, so it always survives
            sorted_probs = sorted_probs.masked_fill((mass_before >= p) & (p < 1.0), 0.0)
            sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        probs = torch.zeros_like(sorted_probs).scatter(-1, order, sorted_probs)

    if greedy is None:
        return probs
    one_hot = torch.zeros_like(probs).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


def sample(
    probs: torch.Tensor,  # [..., V] nonnegative weights (need not be normalised)
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [...] int64 token ids
    """Draw one token per row with probability proportional to `probs`.

    Exponential race: argmax(probs / E) with E ~ Exp(1) i.i.d. picks token i with probability probs_i / sum(probs).
    No host sync and no failure on all-zero rows (which return an arbitrary id), so the verifier can sample every
    row and keep only the ones it needs. Split in two (`exponential_noise`, `pick_with_noise`) where the draw and
    the pick run in different places (the decode step compiles the pick but draws the noise eagerly)."""
    return pick_with_noise(probs, exponential_noise(probs, generator))


def exponential_noise(
    probs: torch.Tensor,  # [..., V] the weights the noise is for (shape and device)
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [..., V] float32, i.i.d. Exp(1)
    return torch.empty(probs.shape, dtype=torch.float32, device=probs.device).exponential_(generator=generator)


def pick_with_noise(
    probs: torch.Tensor,  # [..., V] nonnegative weights
    noise: torch.Tensor,  # [..., V] Exp(1) draws from exponential_noise
) -> torch.Tensor:  # [...] int64 token ids: the exponential race's winner
    return (probs.float() / noise.clamp_min(1e-30)).argmax(dim=-1)


def token_logprobs(
    probs: torch.Tensor,  # [..., V] processed probabilities
    ids: torch.Tensor,  # [...] int64 token ids
) -> torch.Tensor:  # [...] float32 log-prob of each id (-inf where its probability is 0)
    return probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1).float().log()


def sample_without_replacement(
    weights: torch.Tensor,  # [B, V] nonnegative weights (a drafter's q)
    m: int,  # distinct tokens per row (<= number of positive weights for the order to be meaningful)
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [B, m] int64, in draw order
    """m sequential draws without replacement (each from the remaining weights, renormalised), in one pass: the
    exponential race's m fastest finishers, in order (Plackett-Luce). This is how a stochastic tree drafter must
    pick a node's children for verify_sampling to stay exact."""
    e = torch.empty(weights.shape, dtype=torch.float32, device=weights.device).exponential_(generator=generator)
    return torch.topk(weights.float() / e.clamp_min_(1e-30), m, dim=-1).indices
