"""The widened SmolLM2 (`smollm2-135m-instruct@test`, fp32, CPU) computes SmolLM2's function: logits within 1e-5 of
their scale and the engine's greedy tokens identical on GSM8K prompts; the placement keeps every part where it
belongs; the builtin names reach the job spec, the bench and the loader.
Run: python -m pytest tests/engine/test_widen.py -q"""

from __future__ import annotations

import math

import pytest
import torch

from worker.tlt.bench import gsm8k_questions, model_source
from worker.tlt.config import WIDENED_MODELS, JobSpec
from worker.tlt.model.args import preset, shape
from worker.tlt.model.gguf import gguf_checkpoint
from worker.tlt.model.load import build_model, smollm2_gguf_path
from worker.tlt.model.tokenizer import Tokenizer
from worker.tlt.model.transformer import Transformer, rope_inv_freq
from worker.tlt.model.widen import WIDENED_BUILTINS, Widening, parse_name, plan, plan_into, widen_state_dict
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling


@pytest.fixture(scope="module")
def pair() -> tuple[Transformer, Transformer, Widening, Tokenizer]:
    """SmolLM2 and its @test widening from one dequantisation of the GGUF."""
    args, sd, tok = gguf_checkpoint(smollm2_gguf_path())
    wd = plan("test", args)
    wide = build_model(wd.args, widen_state_dict(wd, sd, "cpu", torch.float32), "cpu", torch.float32)
    small = build_model(args, sd, "cpu", torch.float32)
    return small, wide, wd, tok


def _prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in gsm8k_questions("gsm8k", n)]


def test_logits_match_smollm2(pair) -> None:
    """Within fp32 rounding: the widening rescales norm and q weights by non-powers of two and sums over wider, zero-
    padded rows, so logits part by a few ulps of their scale (measured: 1.2e-4 at logits up to 39, 3e-6 of the
    scale); a misplaced head, rope pair or norm scale parts them by whole units."""
    small, wide, _, tok = pair
    worst = scale = 0.0
    with torch.no_grad():
        for ids in _prompts(tok, 6):
            x = torch.tensor([ids])
            want = small(x)
            worst = max(worst, float((wide(x) - want).abs().max()))
            scale = max(scale, float(want.abs().max()))
    assert scale > 10 and worst <= 1e-5 * scale, (worst, scale)


def test_engine_greedy_tokens_match_smollm2(pair) -> None:
    small, wide, _, tok = pair
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=24)) for p in _prompts(tok, 12)]
    cfg = EngineConfig(max_len=320, max_slots=12)
    ref = Engine(small, eos_ids=tok.eos_ids, config=cfg).generate(reqs)
    out = Engine(wide, eos_ids=tok.eos_ids, config=cfg).generate(reqs)
    assert [s.tokens for s in out.sequences] == [s.tokens for s in ref.sequences]
    assert sum(len(s.tokens) for s in out.sequences) >= 12 * 10  # real continuations, not immediate EOS


def test_placement_of_heads_layers_and_rope(pair) -> None:
    _, wide, wd, _ = pair
    a, x = wd.args, wd.small
    assert (a.dim, a.n_heads, a.n_kv_heads, a.hd, a.n_layers) == (640, 16, 4, 128, 31)
    assert a.rope_theta == x.rope_theta and wd.theta_kept  # test target's theta 1e6 cannot give SmolLM2's frequencies
    # each small RoPE pair keeps its frequency in the wide head
    inv_w, inv_x = rope_inv_freq(a), rope_inv_freq(x)
    assert torch.equal(inv_w[list(wd.head_dims[: x.hd // 2])], inv_x)
    layer0 = wide.model.layers[0].self_attn
    q = layer0.qkv_proj.weight[: a.n_heads * a.hd].view(a.n_heads, a.hd, a.dim)
    o = layer0.o_proj.weight.view(a.dim, a.n_heads, a.hd)
    extra_q = sorted(set(range(a.n_heads)) - set(wd.q_heads))
    assert extra_q == [3, 7, 11, 12, 13, 14, 15]  # one per group of 4 (SmolLM2 has 3) and the whole 4th group
    assert q[extra_q].abs().sum() == 0 and o[:, extra_q].abs().sum() == 0
    assert q[list(wd.q_heads)].abs().sum() > 0
    k = layer0.qkv_proj.weight[a.n_heads * a.hd:].view(2 * a.n_kv_heads, a.hd, a.dim)
    assert k[[3, 7]].abs().sum() == 0  # the extra KV head: zero K and V
    # the layer beyond SmolLM2's 30 is an exact identity
    last = wide.model.layers[30]
    assert last.self_attn.o_proj.weight.abs().sum() == 0 and last.mlp.down_proj.weight.abs().sum() == 0
    # RMSNorm weights scaled for the wider mean, padding zero
    n = wide.model.layers[0].input_layernorm.weight
    assert n[x.dim:].abs().sum() == 0 and n[: x.dim].abs().sum() > 0
    assert a.norm_eps == pytest.approx(x.norm_eps * x.dim / a.dim)
    assert math.isclose(wd.args.hd / x.hd, 2.0)


def test_named_targets_and_their_notes() -> None:
    q7 = plan("qwen2.5-7b")
    assert q7.args.n_layers == 30 and q7.theta_kept and "30 layers (target has 28)" in q7.describe()
    assert (q7.args.dim, q7.args.intermediate_size, q7.args.n_heads, q7.args.n_kv_heads) == (3584, 18944, 28, 4)
    l8 = plan("llama3-8b")
    assert l8.args.n_layers == 32 and "layers" not in l8.describe() and "theta 100000" in l8.describe()
    l3 = plan("llama3.2-3b")
    assert l3.args.rope_scaling.kind == "none" and l3.args.n_layers == 30 and "no rope scaling" in l3.describe()
    # a target whose theta already gives SmolLM2's frequencies keeps its own (pair i at wide pair 2i)
    same = plan_into(shape("llama3-8b", rope_theta=100000.0), "llama3-8b-theta1e5", preset("smollm2-135m"))
    assert not same.theta_kept and same.head_dims[:3] == (0, 2, 4)
    with pytest.raises(ValueError, match="cannot hold"):  # 2 KV heads < SmolLM2's 3
        plan_into(shape("qwen2.5-1.5b"), "qwen2.5-1.5b", preset("smollm2-135m"))


def test_builtin_names_reach_spec_bench_and_loader() -> None:
    assert WIDENED_MODELS == WIDENED_BUILTINS
    spec = JobSpec.model_validate({"model": {"builtin": "smollm2-135m-instruct@qwen2.5-7b"}})
    assert spec.model.builtin == "smollm2-135m-instruct@qwen2.5-7b"
    assert model_source("smollm2-135m-instruct@llama3-8b").builtin == "smollm2-135m-instruct@llama3-8b"
    with pytest.raises(ValueError):
        JobSpec.model_validate({"model": {"builtin": "smollm2-135m-instruct@gpt5"}})
    with pytest.raises(KeyError, match="unknown widened model"):
        parse_name("smollm2-135m-instruct@gpt5")
