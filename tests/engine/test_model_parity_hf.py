"""Our Transformer's logits equal transformers' Llama / Qwen2 / Qwen3 (tiny configs, fp32) and, on the real
SmolLM2 GGUF, transformers' own GGUF load. Run: python -m pytest tests/engine/test_model_parity_hf.py -q"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from worker.tlt.config import ModelSource
from worker.tlt.model.args import ModelArgs, RopeScaling, preset
from worker.tlt.model.load import build_model, load_model, random_model, smollm2_gguf_path


def _hf_model(args: ModelArgs):
    import transformers

    cfg_dict = args.to_hf_config()
    cls_cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    cfg = cls_cfg[args.arch](**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    cls_m = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
             "qwen3": transformers.Qwen3ForCausalLM}
    torch.manual_seed(0)
    m = cls_m[args.arch](cfg).eval()
    with torch.no_grad():  # random non-trivial norms and biases so they are exercised
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(torch.rand_like(p) + 0.5 if name.endswith("weight") else torch.randn_like(p) * 0.1)
    return m


@pytest.mark.parametrize(
    "args",
    [
        preset("tiny-llama"),
        preset("tiny-qwen2"),
        preset("tiny-qwen3"),
        replace(preset("tiny-llama"), tie_word_embeddings=False, rope_scaling=RopeScaling("linear", 2.0)),
        replace(preset("tiny-llama"), rope_theta=500000.0,
                rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),
    ],
    ids=["llama", "qwen2", "qwen3", "llama-linear-untied", "llama3-rope"],
)
def test_logits_match_transformers(args: ModelArgs) -> None:
    hf = _hf_model(args)
    ours = build_model(args, dict(hf.state_dict()), "cpu", torch.float32)
    ids = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    ids[:, 30:] = ids[:, :10]  # long enough that the llama3 scaling band matters (positions up to 39 vs 64)
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
        # far positions exercise rope scaling
        pos = torch.arange(600, 640).expand(2, 40)
        ref_far = hf(ids, position_ids=pos).logits
        got_far = ours.forward(ids, positions=pos)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_far, ref_far, atol=1e-5, rtol=1e-4)


def test_forward_hidden_matches_hf_hidden_states() -> None:
    args = preset("tiny-qwen3")
    hf = _hf_model(args)
    ours = build_model(args, dict(hf.state_dict()), "cpu", torch.float32)
    ids = torch.randint(0, args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        logits, h, layers = ours.forward_hidden(ids, layers=(0, 1))
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(h, out.hidden_states[-1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(layers[1], out.hidden_states[1], atol=1e-5, rtol=1e-4)


def test_training_path_has_gradients_and_checkpointing_matches() -> None:
    m = random_model(preset("tiny-llama"), seed=3)
    m.train()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = m(ids).logsumexp(-1).mean()
    loss.backward()
    g1 = m.model.layers[0].mlp.gate_up_proj.weight.grad.clone()
    m.zero_grad()
    m.gradient_checkpointing = True
    m(ids).logsumexp(-1).mean().backward()
    torch.testing.assert_close(m.model.layers[0].mlp.gate_up_proj.weight.grad, g1)


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_gguf_load() -> None:
    import os

    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    model, tok = load_model(ModelSource(builtin="smollm2-135m-instruct"), "cpu", torch.float32)
    d, f = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}])
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=2e-4, rtol=1e-3)
    assert tok.eos_ids and tok.decode(tok.encode("hello world")) == "hello world"


def test_hf_dir_sharded_roundtrip(tmp_path) -> None:
    """An HF directory (sharded safetensors + tokenizer files) loads through load_model with identical logits."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    args = preset("tiny-qwen2")
    hf = _hf_model(args)
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    vocab = {f"t{i}": i for i in range(args.vocab_size)}
    raw = RawTokenizer(WordLevel(vocab, unk_token="t0"))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="t257", pad_token="t258")
    tok.save_pretrained(tmp_path)
    model, tokenizer = load_model(ModelSource(hf_dir=str(tmp_path)), "cpu")
    ids = torch.randint(0, args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-4)
    assert 257 in tokenizer.eos_ids


def test_attention_never_asks_cudnn_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every SDPA call of the model (training forward, cached forward, recomputation under gradient checkpointing)
    runs with cuDNN's backend off: it plans per shape on the host (see SDPA_BACKENDS)."""
    import torch.nn.functional as F

    seen: list[bool] = []
    inner = F.scaled_dot_product_attention

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return inner(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = random_model(preset("tiny-llama"), seed=0)
    model.gradient_checkpointing = True
    model.train()
    model(torch.randint(0, 64, (2, 7))).sum().backward()
    assert seen and not any(seen) and torch.backends.cuda.cudnn_sdp_enabled()
