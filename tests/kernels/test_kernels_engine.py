"""The engine with `EngineConfig.fused_kernels=True` (Triton's interpreter on CPU, tiny fp32 models): greedy decoding
is token-identical to the torch forward's, and greedy speculative decoding (small-model chain, n-gram tree) with the
fused verify forward is token-identical to plain greedy decoding. Plus when the fused path is refused or left off.
Run: python -m pytest tests/kernels/test_kernels_engine.py -q"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worker.tlt.kernels import resolve_fused
from worker.tlt.model.args import preset
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import Arm, chain_arm, tree_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.ngram import NGramProposer
from worker.tlt.speculative.proposers.protocol import Proposer
from worker.tlt.speculative.proposers.small_model import SmallModelProposer


def _generate(model: torch.nn.Module, reqs: list[Request], fused: bool, arm: Arm | None = None,
              proposer: Proposer | None = None) -> list[list[int]]:
    cfg = EngineConfig(max_len=64, max_slots=3, sync_every=3, fused_kernels=fused)
    sd: dict[str, Any] = {} if arm is None or proposer is None else {"controller": AdaptiveSd.fixed(arm),
                                                     "proposers": {arm.drafter: proposer}}
    engine = Engine(model, eos_ids=(257,), config=cfg, **sd)  # type: ignore[arg-type]
    assert engine.step.fused is fused
    return [s.tokens for s in engine.generate(reqs).sequences]


def _requests(n: int, seed: int, new: int) -> list[Request]:
    return [Request(p, RequestSampling(temperature=0.0, max_new_tokens=new + i)) for i, p in
            enumerate(random_prompts(n, seed=seed, hi=12))]


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_fused_greedy_equals_torch(arch: str) -> None:
    model = tiny_target(arch)
    reqs = _requests(4, seed=1, new=8)  # 4 sequences, 3 slots: continuous batching moves rows
    assert _generate(model, reqs, fused=True) == _generate(model, reqs, fused=False)


def test_fused_speculative_chain_equals_plain() -> None:
    model = tiny_target()
    reqs = _requests(3, seed=2, new=10)
    plain = _generate(model, reqs, fused=True)
    drafter = SmallModelProposer(perturbed_copy(model, noise=0.15))
    spec = _generate(model, reqs, fused=True, arm=chain_arm("small", 3), proposer=drafter)
    assert spec == plain


def test_fused_speculative_tree_equals_plain() -> None:
    model = tiny_target("tiny-qwen2")
    reqs = [Request([5, 6, 7, 5, 6, 7, 5, 6] * 2, RequestSampling(temperature=0.0, max_new_tokens=12))]
    plain = _generate(model, reqs, fused=True)
    spec = _generate(model, reqs, fused=True, arm=tree_arm("ngram", 2, 2, 5), proposer=NGramProposer())
    assert spec == plain


def test_resolve_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    args = preset("tiny-llama")
    assert resolve_fused(None, args, cpu, torch.float32) is False  # auto: CUDA only
    assert resolve_fused(False, args, cpu, torch.float32) is False
    assert resolve_fused(True, args, cpu, torch.float32) is True  # the interpreter (this folder's conftest)
    with pytest.raises(ValueError, match="head_dim 24"):
        resolve_fused(True, preset("tiny-llama", head_dim=24), cpu, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        resolve_fused(True, args, cpu, torch.float64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_fused(True, args, cpu, torch.float32)


def test_fused_max_seqs_routes_large_batches_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """DecodeStep.forward_hidden takes the fused kernels for batches of up to fused_max_seqs sequences whatever their
    tokens per sequence (a batch's decode and verify agree), torch above."""
    from worker.tlt.rollout.decode_step import DecodeStep

    model = tiny_target()
    engine = Engine(model, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=4, fused_kernels=True))
    step = DecodeStep(model, engine.cache, engine.rows, fused=True, fused_max_seqs=2)
    torch_calls: list[int] = []
    torch_forward = model.forward_hidden

    def spy(ids: torch.Tensor, *a: object, **kw: object) -> object:
        torch_calls.append(ids.shape[0])
        return torch_forward(ids, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(model, "forward_hidden", spy)
    for b, s in [(2, 2), (1, 5), (2, 7), (4, 1), (3, 2)]:
        ids = torch.randint(0, 300, (b, s))
        pos = torch.arange(s).expand(b, s).contiguous()
        mask = torch.ones(b, s, 8, dtype=torch.bool).tril()
        logits, _, _ = step.forward_hidden(ids, pos, engine.cache, write_idx=pos, attn_mask=mask)
        assert logits.shape == (b, s, model.args.vocab_size)
    assert torch_calls == [4, 3]


def test_small_prefill_chunks_run_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk of at most FUSED_PREFILL_TOKENS padded tokens runs the fused kernels (a batch-1 prompt was a
    host-bound torch forward), a larger one the model's torch forward; both give the same first tokens."""
    from worker.tlt.rollout import prefill as prefill_mod

    model = tiny_target()
    torch_calls: list[tuple[int, int]] = []
    torch_forward = model.forward_hidden

    def spy(ids: torch.Tensor, *a: object, **kw: object) -> object:
        torch_calls.append(tuple(ids.shape))
        return torch_forward(ids, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(model, "forward_hidden", spy)
    prompts = random_prompts(2, seed=4, hi=12)  # padded to 16 tokens each: one chunk of 2 x 16 = 32 tokens
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=1)) for p in prompts]
    cfg = EngineConfig(max_len=64, max_slots=2, fused_kernels=True)
    fused_first = [s.tokens for s in Engine(model, eos_ids=(257,), config=cfg).generate(reqs).sequences]
    assert torch_calls == []
    monkeypatch.setattr(prefill_mod, "FUSED_PREFILL_TOKENS", 31)
    torch_first = [s.tokens for s in Engine(model, eos_ids=(257,), config=cfg).generate(reqs).sequences]
    assert torch_calls == [(2, 16)]
    assert fused_first == torch_first


def test_sampled_first_tokens_of_later_rows_fused_equal_torch_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """T = 0.8, top-k 20, 5 requests in 3 slots: the prefill's first tokens of rows that join past the active ones go
    through the fused sampler at a row offset; tokens and log-probs equal those of the same engine with the torch
    sampler (same seed, same draws)."""
    from worker.tlt.rollout.decode_step import DecodeStep

    model = tiny_target()
    reqs = [Request(p, RequestSampling(temperature=0.8, top_k=20, max_new_tokens=3 + 2 * i)) for i, p in
            enumerate(random_prompts(5, seed=9, hi=12))]

    def run() -> list[tuple[list[int], list[float]]]:
        cfg = EngineConfig(max_len=64, max_slots=3, sync_every=2, fused_kernels=True, seed=5)
        out = Engine(model, eos_ids=(), config=cfg).generate(reqs).sequences
        return [(s.tokens, s.logprobs) for s in out]

    calls: list[int] = []
    real = DecodeStep.fused_tail

    def spy(self: DecodeStep, *a: object, **kw: object) -> torch.Tensor:
        calls.append(int(kw.get("row0", 0)))  # type: ignore[arg-type]
        return real(self, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeStep, "fused_tail", spy)
    fused = run()
    assert max(calls) > 0  # some first tokens committed past row 0
    monkeypatch.setattr(DecodeStep, "samples_fused", lambda self, mode, batch=1: False)
    want = run()
    assert [t for t, _ in fused] == [t for t, _ in want]
    for (_, lp_f), (_, lp_w) in zip(fused, want, strict=True):
        torch.testing.assert_close(torch.tensor(lp_f), torch.tensor(lp_w), atol=1e-5, rtol=0.0)
