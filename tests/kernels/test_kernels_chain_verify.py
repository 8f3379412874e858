"""The fused chain verifier (worker/tlt/kernels/chain_verify.py) against its definition, verify_sampling(
processed_probs(logits, T)) of a chain, with the same uniforms and noise: tokens, num_emitted and accepted_nodes
exactly, log-probs to 1e-5, over seeds, temperatures, ragged counts (root-only rows), drafters with and without q,
full acceptance (q = p), early rejection (q disjoint from p), a rejection with an all-zero residual, a depth bound
below the chain, several vocabulary tiles and several parallel chunks (boundaries inside a tile, ties across
chunks). CPU cases run in Triton's interpreter (tests/conftest.py); the `gpu` case runs compiled at SmolLM2's
vocabulary in bf16, and the engine case checks that spec_body's routing changes no token (same generator draws).
Run: python -m pytest tests/kernels/test_kernels_chain_verify.py -q   (GPU: add -m gpu)"""

from __future__ import annotations

import os

import pytest
import torch

from worker.tlt.decoding.draft_types import DraftProposal, VerifyResult
from worker.tlt.decoding.sampling import processed_probs
from worker.tlt.kernels import chain_verify as cv
from worker.tlt.kernels.chain_verify import chain_verify
from worker.tlt.rollout import speculative_body
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.ngram import NGramProposer
from worker.tlt.speculative.proposers.small_model import SmallModelProposer
from worker.tlt.speculative.verify.verifier import verify_sampling


def _case(r: int, w: int, v: int, seed: int, drafter: str, temp: float, device: str = "cpu",
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, DraftProposal, torch.Tensor, torch.Tensor]:
    """Logits [R, W, V], a chain proposal with ragged counts (row 0 root-only when R > 1), uniforms [R, W - 1],
    noise [R, V]. drafter: "q" (a perturbed q, drafts sampled from it), "same" (q = p: all accepted), "disjoint"
    (q lives where p is 0: the first draft is rejected), "det" (no q; drafts are p's argmax or random ids)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(r, w, v, generator=g) * 3.0
    if drafter == "disjoint":
        logits[..., v // 2:] = -1.0e4  # p(x) = 0 in fp32 on the upper half
    logits = logits.to(dtype).float()  # what the kernel will read
    p = processed_probs(logits, temp)
    if drafter == "same":
        q = p.clone()
    elif drafter == "disjoint":
        q = torch.zeros(r, w, v)
        q[..., v // 2:] = torch.rand(r, w, v - v // 2, generator=g)
        q = q / q.sum(-1, keepdim=True)
    elif drafter == "q":
        q = processed_probs(logits + torch.randn(r, w, v, generator=g) * 1.5, temp) * 3.0  # unnormalised on purpose
    else:
        q = None
    counts = torch.randint(1, w + 1, (r,), generator=g)
    counts[0] = 1 if r > 1 else counts[0]
    counts[-1] = w
    tokens = torch.randint(0, v, (r, w), generator=g)
    for i in range(1, w):  # draft i is drawn from the drafter's row i - 1
        if q is not None:
            tokens[:, i] = torch.multinomial(q[:, i - 1], 1, generator=g).squeeze(1)
        elif seed % 2 == 0:
            tokens[:, i] = p[:, i - 1].argmax(-1)
    node = torch.arange(w)
    parents = torch.where((node[None, :] > 0) & (node[None, :] < counts[:, None]), node[None, :] - 1, -1)
    uniforms = torch.rand(r, max(w - 1, 1), generator=g)
    noise = torch.empty(r, v).exponential_(generator=g)
    dev = torch.device(device)
    prop = DraftProposal(tokens.to(dev), parents.to(dev), counts.to(dev), None if q is None else q.to(dev))
    return logits.to(dtype).to(dev), prop, uniforms.to(dev), noise.to(dev)


def _both(logits: torch.Tensor, prop: DraftProposal, uniforms: torch.Tensor, noise: torch.Tensor, depth: int,
          temp: float, block_v: int | None = None, chunk_v: int | None = None) -> tuple[VerifyResult, VerifyResult]:
    want = verify_sampling(prop, processed_probs(logits, temp), max_depth=depth, max_children=1, uniforms=uniforms,
                           noise=noise)
    got = chain_verify(logits, prop.tokens, prop.counts, prop.draft_probs, depth, temp, uniforms=uniforms,
                       noise=noise, block_v=block_v, chunk_v=chunk_v)
    return want, got


def _assert_same(want: VerifyResult, got: VerifyResult) -> None:
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.num_emitted, want.num_emitted)
    assert torch.equal(got.accepted_nodes, want.accepted_nodes)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temp", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("drafter", ["q", "det"])
def test_equals_verify_sampling(temp: float, drafter: str) -> None:
    emitted = []
    for seed, v in ((0, 137), (1, 97)):
        # seed 1: four vocabulary tiles, the last one ragged, in three chunks of 48 columns (a boundary mid-tile)
        want, got = _both(*_case(5, 5, v, seed, drafter, temp), depth=4, temp=temp,
                          block_v=32 if seed == 1 else None, chunk_v=48 if seed == 1 else None)
        _assert_same(want, got)
        emitted.append(want.num_emitted)
    n = torch.cat(emitted)
    assert int(n.min()) == 1 and int(n.max()) > 1  # both rejections / root-only rows and accepted runs


@pytest.mark.parametrize("temp", [0.7, 1.3])
def test_full_acceptance_and_bonus(temp: float) -> None:
    logits, prop, uniforms, noise = _case(4, 5, 64, 3, "same", temp)
    want, got = _both(logits, prop, uniforms, noise, depth=4, temp=temp, block_v=16, chunk_v=64)  # 4 tiles, 1 chunk
    _assert_same(want, got)
    assert torch.equal(got.num_emitted, prop.counts)  # every draft accepted, plus the bonus


def test_early_rejection_residual() -> None:
    logits, prop, uniforms, noise = _case(4, 4, 257, 5, "disjoint", 1.0)
    want, got = _both(logits, prop, uniforms, noise, depth=3, temp=1.0, block_v=64)  # 5 chunks of one tile
    _assert_same(want, got)
    assert torch.equal(got.num_emitted, torch.ones(4, dtype=torch.int64))
    assert bool((got.tokens[:, 0] < 257 // 2).all())  # recovered from the residual = p's half of the vocabulary


def test_depth_bound_below_chain() -> None:
    logits, prop, uniforms, noise = _case(3, 5, 80, 7, "same", 1.0)
    want, got = _both(logits, prop, uniforms, noise, depth=2, temp=1.0)
    _assert_same(want, got)
    assert got.tokens.shape == (3, 3) and int(got.num_emitted.max()) == 3  # capped at D: bonus from node 2
    want, got = _both(logits, prop, uniforms, noise, depth=0, temp=1.0)  # D = 0: one draw from the root
    _assert_same(want, got)


def test_draws_missing_randomness_like_verify_sampling() -> None:
    logits, prop, _, _ = _case(3, 4, 70, 9, "q", 0.9)
    want = verify_sampling(prop, processed_probs(logits, 0.9), torch.Generator().manual_seed(1), max_depth=3,
                           max_children=1)
    got = chain_verify(logits, prop.tokens, prop.counts, prop.draft_probs, 3, 0.9,
                       generator=torch.Generator().manual_seed(1))
    _assert_same(want, got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run compiled, alone with -m gpu")
@pytest.mark.parametrize("drafter", ["q", "det", "same"])
def test_gpu_smollm2_vocab_bf16(drafter: str) -> None:
    """R = 8, W = 7, V = 49152, bf16 logits, 100 seeds x 3 temperatures = 2400 rows: rows differing from torch must
    be float ties (last-ulp exp / sum rounding), i.e. at most a few per 1e4 rows; log-probs within 1e-4 elsewhere."""
    bad = rows = 0
    for seed in range(100):
        temp = (0.7, 1.0, 1.3)[seed % 3]
        want, got = _both(*_case(8, 7, 49152, seed, drafter, temp, "cuda", torch.bfloat16), depth=6, temp=temp)
        same = ((got.tokens == want.tokens).all(1) & (got.num_emitted == want.num_emitted)
                & (got.accepted_nodes == want.accepted_nodes).all(1))
        bad += int((~same).sum())
        rows += same.numel()
        torch.testing.assert_close(got.logprobs[same], want.logprobs[same], atol=1e-4, rtol=1e-4)
    assert bad <= max(1, rows * 5 // 10_000), f"{bad} of {rows} rows differ"


@pytest.mark.parametrize("chunk_v", [None, 40, 96])
def test_race_ties_pick_the_first_index_across_tiles(chunk_v: int | None) -> None:
    """Equal weights / noise in tiles 0 and 2 (and twice inside tile 2): torch.argmax's first index wins, whether the
    tie spans chunks (one per tile; 40 columns: 5 in chunk 0, 70 and 75 in chunk 1) or lies inside one (96)."""
    logits = torch.zeros(1, 2, 96)
    logits[0, :, [5, 70, 75]] = 4.0
    prop = DraftProposal(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([[-1, -1]]), torch.tensor([1]))
    want, got = _both(logits, prop, torch.rand(1, 1), torch.ones(1, 96), depth=1, temp=1.0, block_v=32,
                      chunk_v=chunk_v)
    _assert_same(want, got)
    assert int(got.tokens[0, 0]) == 5


def test_all_zero_residual_falls_back_to_p() -> None:
    """p = q = 1/2 on tokens 3 and 40 (chunks 0 and 2 of 16 columns) and u = 1: the draft 3 is rejected with an
    all-zero residual, so row 0 draws from p (40 by its noise; the residual race alone would give 0). Row 1's q is
    one-hot on 3: its residual, 1/2 on 40, wins over p's race, which its noise sends to 3."""
    logits = torch.full((2, 2, 48), -1.0e4)
    logits[:, :, [3, 40]] = 0.0
    q = torch.zeros(2, 2, 48)
    q[0, :, [3, 40]] = 0.5
    q[1, :, 3] = 1.0
    prop = DraftProposal(torch.tensor([[0, 3], [0, 3]]), torch.tensor([[-1, 0], [-1, 0]]), torch.tensor([2, 2]), q)
    noise = torch.ones(2, 48)
    noise[0, 40] = 0.5
    noise[1, 3] = 0.1
    want, got = _both(logits, prop, torch.ones(2, 1), noise, depth=1, temp=1.0, block_v=16, chunk_v=16)
    _assert_same(want, got)
    assert got.tokens.tolist() == [[40, 0], [40, 0]] and got.num_emitted.tolist() == [1, 1]


def test_default_chunk_fills_the_gpu() -> None:
    """Batch 8 at V = 49152: one 2048-column tile per chunk (192 race programs); batch 64: 6 tiles (256 programs)."""
    assert cv.default_chunk(8, 49152, 2048) == 2048
    assert cv.default_chunk(64, 49152, 2048) == 6 * 2048
    assert cv.default_chunk(1, 100, 128) == 128


@pytest.mark.parametrize("drafter", ["small", "ngram"])
def test_engine_routing_changes_no_token(drafter: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled chain SD (T = 0.8) through spec_body with the kernel routed in (its CUDA condition lifted: the
    interpreter) emits exactly the torch path's tokens: same acceptance, same draws from the rows' own streams."""
    target = tiny_target()
    reqs = [Request(p * 2, RequestSampling(temperature=0.8, max_new_tokens=12)) for p in random_prompts(3, seed=5)]

    def tokens() -> tuple[list[list[int]], tuple[float, float]]:
        prop = NGramProposer() if drafter == "ngram" else SmallModelProposer(perturbed_copy(target, 0.15))
        eng = Engine(target, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=4, seed=3),
                     controller=AdaptiveSd.fixed(chain_arm(drafter, 3)), proposers={drafter: prop})  # type: ignore[arg-type]
        out = [s.tokens for s in eng.generate(reqs).sequences]
        return out, (eng.accept_stats.mean_accept_len, eng.accept_stats.tokens_per_verify_node)

    plain, stats = tokens()
    calls = []

    def spy(*args: object, **kw: object) -> object:
        calls.append(1)
        return chain_verify(*args, **kw)  # type: ignore[arg-type]

    def route(logits: torch.Tensor, mode: tuple, *, chain: bool, topk: int) -> bool:
        return chain and topk == 1 and mode[0] == "uniform" and mode[2] >= 1.0 and mode[3] <= 0

    monkeypatch.setattr(cv, "chain_verify", spy)
    monkeypatch.setattr(speculative_body, "fused_chain_verify", route)
    assert tokens() == (plain, stats)
    assert calls and stats[1] < 1.0  # drafts were sent and some rejected (residual draws)
    assert drafter == "ngram" or stats[0] > 1.0  # the small drafter's q gets drafts accepted
