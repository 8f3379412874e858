"""HF names <-> our fused projections (model/hf_names.py), and that fusing changed no numerics: an HF state dict
round-trips exactly, loads into our model (also by plain `load_state_dict`), and the one-pass RoPE over the fused q/k
heads and the cast-free RMSNorm round exactly as before / as HF. Logit parity with transformers lives in
test_model_parity_hf.py. Run: python -m pytest tests/engine/test_hf_names.py -q"""

from __future__ import annotations

import pytest
import torch

from worker.tlt.model.args import ModelArgs, preset
from worker.tlt.model.hf_names import to_fused, to_hf
from worker.tlt.model.load import build_model, random_model
from worker.tlt.model.transformer import RMSNorm, Transformer, apply_rope


def _hf_named(args: ModelArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random HF-named state dict of `args`' shapes (q/k/v sizes differ under GQA; Qwen2 has q/k/v biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in to_hf(Transformer(args).state_dict(), args).items()}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_hf_state_dict_round_trips_through_fused_names(name: str) -> None:
    args = preset(name, n_kv_heads=2)  # GQA: k/v narrower than q
    hf = _hf_named(args)
    assert "model.layers.1.self_attn.k_proj.weight" in hf and "model.layers.0.mlp.up_proj.weight" in hf
    if args.qkv_bias:
        assert "model.layers.0.self_attn.v_proj.bias" in hf
    fused = to_fused(hf)
    assert not any(k.endswith(("q_proj.weight", "k_proj.weight", "gate_proj.weight")) for k in fused)
    assert fused["model.layers.0.self_attn.qkv_proj.weight"].shape[0] == (args.n_heads + 2 * 2) * args.hd
    assert to_fused(fused).keys() == fused.keys()  # already ours: unchanged
    back = to_hf(fused, args)
    assert list(back) == list(hf)  # same names in the same order
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    a, b = back["model.layers.0.self_attn.q_proj.weight"], back["model.layers.0.self_attn.k_proj.weight"]
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()  # safetensors needs separate storage


def test_model_loads_hf_names_and_state_dict_is_fused() -> None:
    args = preset("tiny-qwen2")
    hf = _hf_named(args, seed=1)
    model = build_model(args, hf, "cpu", torch.float32)
    sd = model.state_dict()
    assert "model.layers.0.self_attn.qkv_proj.bias" in sd and "model.layers.0.self_attn.q_proj.weight" not in sd
    torch.testing.assert_close(to_hf(sd, args)["model.layers.1.mlp.gate_proj.weight"],
                               hf["model.layers.1.mlp.gate_proj.weight"], rtol=0, atol=0)
    # plain load_state_dict takes HF names too (strict: nothing dropped) and leaves the caller's dict alone
    other = random_model(args, seed=5)
    other.load_state_dict(hf, strict=True)
    assert "model.layers.0.self_attn.q_proj.weight" in hf
    ids = torch.randint(0, args.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(other(ids), model(ids), rtol=0, atol=0)


def test_incomplete_projection_group_is_an_error() -> None:
    hf = _hf_named(preset("tiny-llama"))
    del hf["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(KeyError, match="v_proj"):
        to_fused(hf)


def test_random_model_weights_are_drawn_per_hf_tensor() -> None:
    """The seeded tiny models keep the weights they had before the fusion (each HF tensor drawn in turn)."""
    args = preset("tiny-llama")
    m = random_model(args, seed=0)
    g = torch.Generator().manual_seed(0)
    first = torch.randn(args.vocab_size, args.dim, generator=g) * 0.02  # model.embed_tokens.weight
    q = torch.randn(args.n_heads * args.hd, args.dim, generator=g) * 0.02  # then layer 0's q_proj
    torch.testing.assert_close(m.model.embed_tokens.weight, first, rtol=0, atol=0)
    qkv = m.state_dict()["model.layers.0.self_attn.qkv_proj.weight"]
    torch.testing.assert_close(qkv[: q.shape[0]], q, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_rounds_as_the_per_tensor_form(dtype: torch.dtype) -> None:
    """apply_rope over a strided slice of the fused q/k heads equals the old form (x * cos, then addcmul with
    roll(x, D/2)) bit for bit, and HF's x * cos + rotate_half(x) * sin in fp32."""
    b, s, hq, hkv, d = 2, 5, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(b, s, hq + 2 * hkv, d, generator=g).to(dtype)
    qk = qkv[:, :, : hq + hkv]  # not contiguous
    ang = torch.randn(b, s, 1, d // 2, generator=g)
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dtype)
    sin_signed = torch.cat((-ang.sin(), ang.sin()), -1).to(dtype)
    got = apply_rope(qk, cos, sin_signed)
    old = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin_signed)
    assert torch.equal(got, old)
    if dtype == torch.float32:
        x1, x2 = qk.chunk(2, -1)
        hf = qk * cos + torch.cat((-x2, x1), -1) * torch.cat((ang.sin(), ang.sin()), -1)
        torch.testing.assert_close(got, hf)


def test_rms_norm_rounds_as_hf_in_bf16() -> None:
    """HF LlamaRMSNorm: fp32 normalise, round to bf16, then scale. Ours must match it bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 7, 64, generator=g) * 3).to(torch.bfloat16)
    w = (torch.rand(64, generator=g) + 0.5).to(torch.bfloat16)
    ours, hf = RMSNorm(64, 1e-5).to(torch.bfloat16), LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(w)
        hf.weight.copy_(w)
        assert torch.equal(ours(x), hf(x))
