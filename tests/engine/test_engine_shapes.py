"""The engine at the real architectures' head and group shapes, on CPU in fp32: head_dim 128 with GQA groups of 4, 7
and 8 (Qwen2 q/k/v biases, Qwen3 q/k norm, Llama-3 RoPE scaling), in small widths. Our logits equal transformers'
(1e-5), greedy speculative decoding is token-identical to plain greedy, and sharded safetensors checkpoints
(model-0000N-of-0000M + index.json) load with tied and untied heads; the KV cache of a 7B model is planned from the
free device memory.
Run: python -m pytest tests/engine/test_engine_shapes.py -q"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.kernels.cases import REAL_HEADS
from worker.tlt.model.args import ModelArgs, shape
from worker.tlt.model.hf_names import to_hf
from worker.tlt.model.load import build_model, load_hf_state_dict, random_model
from worker.tlt.model.memory_plan import plan_kv
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.small_model import SmallModelProposer


def _hf(args: ModelArgs):  # type: ignore[no-untyped-def]
    import transformers

    cfg = transformers.AutoConfig.for_model(**args.to_hf_config())
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that both are exercised
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand_like(p) + 0.5)
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    return m


@pytest.mark.parametrize("name", list(REAL_HEADS))
def test_logits_match_transformers_at_real_head_shapes(name: str) -> None:
    args = REAL_HEADS[name]
    hf = _hf(args)
    ours = build_model(args, dict(hf.state_dict()), "cpu", torch.float32)
    ids = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    far = torch.arange(700, 724).expand(2, 24)  # past the llama3 band's original context (64)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.forward(ids, positions=far), hf(ids, position_ids=far).logits, atol=1e-5,
                                   rtol=1e-4)


@pytest.mark.parametrize("name", list(REAL_HEADS))
def test_greedy_sd_identical_at_real_head_shapes(name: str) -> None:
    target = random_model(REAL_HEADS[name], seed=1, std=0.1)
    drafter = perturbed_copy(target, noise=0.15)
    prompts = random_prompts(3, seed=5)
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=12 + 3 * i)) for i, p in enumerate(prompts)]

    def run(sd: bool):  # type: ignore[no-untyped-def]
        engine = Engine(target, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=3, sync_every=4),
                        controller=AdaptiveSd.fixed(chain_arm("small", 7)) if sd else None,
                        proposers={"small": SmallModelProposer(drafter)})
        return engine.generate(reqs)

    plain, sd = run(False), run(True)
    assert [s.tokens for s in sd.sequences] == [s.tokens for s in plain.sequences]
    assert sum(s.accepted for s in sd.steps) > 0  # the drafter was right some of the time: real acceptance
    assert any(s.kind == "spec" and s.accepted < s.verify_tokens - 1 for s in sd.steps)  # and wrong some: roll-back


def _write_shards(sd: dict[str, torch.Tensor], path: Path, shards: int) -> None:
    from safetensors.torch import save_file

    names = sorted(sd)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: sd[n].contiguous() for n in part}, str(path / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_sharded_checkpoint_loads_tied_and_untied(tmp_path: Path, tied: bool) -> None:
    args = replace(REAL_HEADS["qwen2.5-7b-g7"], tie_word_embeddings=tied)
    model = random_model(args, seed=3)
    sd = to_hf(model.state_dict(), args)
    assert ("lm_head.weight" in sd) is not tied
    _write_shards(sd, tmp_path, shards=3)
    loaded = build_model(args, load_hf_state_dict(tmp_path), "cpu", torch.float32)
    assert (loaded.lm_head is None) is tied
    ids = torch.randint(0, args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_kv_plan_for_a_7b_model_on_an_h200() -> None:
    args = shape("qwen2.5-7b")
    row = 4096 * 28 * 2 * 4 * 128 * 2  # bytes of one 4,096-column row
    plan = plan_kv(args, 4096, free_bytes=125 * 2**30)
    assert plan.slots == (int(125 * 2**30 * 0.9) - plan.reserved_bytes) // row
    assert 400 < plan.slots < 500 and plan.cache_bytes == plan.slots * row
    assert plan.reserved_bytes > 2 << 30  # activations and sampler tensors on top of the fixed reserve
    assert plan_kv(args, 4096, free_bytes=125 * 2**30, max_slots=64).slots == 64
    assert plan_kv(args, 1024, free_bytes=125 * 2**30).slots > 4 * plan.slots - 4  # a quarter of the columns
    with pytest.raises(ValueError, match="no KV-cache row of 4096 columns fits"):
        plan_kv(args, 4096, free_bytes=3 * 2**30)
