"""Per-sequence random streams: every random number a sequence draws is a pure function of its stream key, the
emitted-token index it decides, what the draw is for and a draw index, never of a shared generator's position.

So a sequence samples the same tokens whichever other sequences share its steps (batch composition, continuous
batching, bucket padding) and whether or not it was preempted and resumed in between; eager, CUDA-graph and fused
kernel paths read the same numbers (they are tensors produced here, handed to the kernels).

Counter-based, splitmix64 style, on int64 tensors (torch multiplies int64 modulo 2^64; logical right shifts are
masked arithmetic ones):
- `sequence_key(seed, sample)` (host): a sequence's 64-bit key from its request's seed and its index among the
  request's samples (GRPO siblings share the seed and differ by the index); the engine stores it in
  `RowState.key`, so it moves, swaps out and back with the row's other state;
- `draw_keys(keys [B], pos [B], purpose)`: one key per row for the draws of one decision: `pos` the index of the
  emitted token being decided (RowState.n_gen at the step; a draft's, n_gen + its depth), `purpose` one of SAMPLE /
  ACCEPT / RESIDUAL / DRAFT;
- `uniforms(rk, n)` / `exponentials(rk, n)`: element i of row b is mix64(rk[b] + (i + 1) * GOLDEN), its top 24 bits
  as a float32 uniform (u in [0, 1); exponentials -log of the centred (u + 2^-25), in (0, ~17.3]).
A step keyed on a row's emitted count never reuses a (pos, purpose) pair: every step emits at least one token, so a
sequence's draws are fresh i.i.d. numbers step after step, which is all exact sampling and speculative acceptance need.

Run the tests: `python -m pytest tests/engine/test_engine_streams.py -q`.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment (2^64 / golden ratio)
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB

# what a draw decides (one stream per purpose and decided token)
SAMPLE = 1  # the Exp(1) race of a plainly sampled token (decode, prefill's first token)
ACCEPT = 2  # speculative acceptance uniforms (one per tried child)
RESIDUAL = 3  # the Exp(1) race of the token a speculative step draws last (residual or bonus)
DRAFT = 4  # a drafter's sampled proposals, keyed on the index the draft proposes (kernels.draft_noise): a later
# step may redraw a position's drafts with the same numbers, as exactness needs only the ACCEPT / RESIDUAL draws fresh


def _signed(x: int) -> int:
    """A uint64 as the int64 with the same bits (torch has no uint64 arithmetic)."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def mix64_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (host side, the same function as `mix64`)."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * _M1) & MASK64
    x = ((x ^ (x >> 27)) * _M2) & MASK64
    return x ^ (x >> 31)


def sequence_key(seed: int, sample: int) -> int:
    """The int64 stream key of sample `sample` of a request seeded `seed` (any Python int)."""
    return _signed(mix64_int(mix64_int(seed & MASK64) + (sample + 1) * GOLDEN))


def request_seed(base: int, request: int) -> int:
    """The seed of request `request` of a generate() call whose base seed is `base` (requests without their own)."""
    return mix64_int((base & MASK64) ^ mix64_int(request + 1))


_S1, _S2, _G = _signed(_M1), _signed(_M2), _signed(GOLDEN)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (bits as uint64; wraps modulo 2^64)."""
    x = (x ^ _shr(x, 30)) * _S1
    x = (x ^ _shr(x, 27)) * _S2
    return x ^ _shr(x, 31)


def draw_keys(
    keys: torch.Tensor,  # [B] int64 sequence keys (RowState.key)
    pos: torch.Tensor,  # [B] int64 index of the emitted token decided (RowState.n_gen at the step)
    purpose: int,  # SAMPLE / ACCEPT / RESIDUAL / DRAFT (+ a depth for drafts)
) -> torch.Tensor:  # [B] int64 one key per row for this decision's draws
    return mix64(keys ^ mix64(pos * 64 + purpose))


def _bits24(rk: torch.Tensor, n: int) -> torch.Tensor:  # [B] -> [B, n] float32 integers in [0, 2^24)
    i = torch.arange(1, n + 1, dtype=torch.int64, device=rk.device)
    return _shr(mix64(rk[:, None] + i[None, :] * _G), 40).to(torch.float32)


def uniforms(rk: torch.Tensor, n: int) -> torch.Tensor:  # [B] draw keys -> [B, n] float32 U[0, 1)
    return _bits24(rk, n) * (1.0 / (1 << 24))


def exponentials(rk: torch.Tensor, n: int) -> torch.Tensor:  # [B] draw keys -> [B, n] float32 Exp(1)
    return -torch.log((_bits24(rk, n) + 0.5) * (1.0 / (1 << 24)))


def row_uniforms(keys: torch.Tensor, pos: torch.Tensor, purpose: int, n: int) -> torch.Tensor:  # -> [B, n]
    return uniforms(draw_keys(keys, pos, purpose), n)


def row_exponentials(keys: torch.Tensor, pos: torch.Tensor, purpose: int, n: int) -> torch.Tensor:  # -> [B, n]
    return exponentials(draw_keys(keys, pos, purpose), n)
