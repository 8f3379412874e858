"""The engine at the real architectures' head and group shapes, on CPU in fp32: head_dim 128 with GQA groups of 4, 7
and 8 (Qwen2 q/k/v biases, Qwen3 q/k norm, Llama-3 RoPE scaling), in small widths. Our logits equal transformers'
(1e-5), greedy speculative decoding is token-identical to plain greedy, and sharded safetensors checkpoints
(model-0000N-of-0000M + index.json) load with tied and untied heads.
Run: python -m pytest tests/engine/test_engine_shapes.py -q"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from worker.tlt.model.args import ModelArgs, RopeScaling, shape
from worker.tlt.model.hf_names import to_hf
from worker.tlt.model.load import build_model, load_hf_state_dict, random_model
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts
from worker.tlt.rollout.types import EngineConfig, Request, SamplingParams, SpecConfig
from worker.tlt.spec.small_model import SmallModelConfig, SmallModelProposer


def small(name: str, n_heads: int, n_kv_heads: int) -> ModelArgs:
    """SHAPES[name] with its head_dim (128), GQA group and family features, in two layers of width 256."""
    return replace(shape(name), vocab_size=320, dim=256, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads,
                   head_dim=128, intermediate_size=384, max_seq_len=1024, eos_token_ids=(257,))


SMALL = {
    "qwen2.5-7b-g7": small("qwen2.5-7b", 7, 1),  # 28 / 4 heads: groups of 7, q/k/v biases
    "llama3-8b-g4": replace(small("llama3-8b", 8, 2), rope_theta=500000.0,  # groups of 4, Llama-3 scaling
                            rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),
    "qwen3-8b-g8": small("qwen3-8b", 8, 1),  # groups of 8, q/k norm
}


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


@pytest.mark.parametrize("name", list(SMALL))
def test_logits_match_transformers_at_real_head_shapes(name: str) -> None:
    args = SMALL[name]
    hf = _hf(args)
    ours = build_model(args, dict(hf.state_dict()), "cpu", torch.float32)
    ids = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    far = torch.arange(700, 724).expand(2, 24)  # past the llama3 band's original context (64)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.forward(ids, positions=far), hf(ids, position_ids=far).logits, atol=1e-5,
                                   rtol=1e-4)


@pytest.mark.parametrize("name", list(SMALL))
def test_greedy_sd_identical_at_real_head_shapes(name: str) -> None:
    target = random_model(SMALL[name], seed=1, std=0.1)
    drafter = perturbed_copy(target, noise=0.15)
    prompts = random_prompts(3, seed=5)
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=12 + 3 * i)) for i, p in enumerate(prompts)]

    def run(spec: SpecConfig | None):  # type: ignore[no-untyped-def]
        proposer = SmallModelProposer(drafter, SmallModelConfig(topk=1)) if spec is not None else None
        engine = Engine(target, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=3, sync_every=4),
                        spec=spec, proposer=proposer)
        return engine.generate(reqs)

    plain, sd = run(None), run(SpecConfig("on", "chain", depth=7))
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
    args = replace(SMALL["qwen2.5-7b-g7"], tie_word_embeddings=tied)
    model = random_model(args, seed=3)
    sd = to_hf(model.state_dict(), args)
    assert ("lm_head.weight" in sd) is not tied
    _write_shards(sd, tmp_path, shards=3)
    loaded = build_model(args, load_hf_state_dict(tmp_path), "cpu", torch.float32)
    assert (loaded.lm_head is None) is tied
    ids = torch.randint(0, args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
