"""Drafter export: exactly the config fields, tensor names, shapes and dtypes that vLLM and SGLang load, and an
export -> reload round trip that drafts identically.

The expected tables are derived from the public loaders:
- EAGLE-3: vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM.load_weights: `midlayer.` -> layers.0,
  d2t -> draft_id_to_target_id, t2d skipped, lm_head [draft_vocab_size, H]; qkv input 2H; fc [H, 3 * target H]) and
  python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3: `midlayer`, hidden_norm, fc [H, 3H],
  lm_head [draft_vocab_size, H] when tie_word_embeddings is false, d2t -> hot_token_id).
- EAGLE-1: vllm/model_executor/models/llama_eagle.py (fc [H, 2H] without bias; layer 0 input_layernorm is Identity;
  embed_tokens skipped, lm_head from the target) and python/sglang/srt/models/llama_eagle.py (fc = nn.Linear(2H, H)
  with its default bias; `layers.{i}`; layer 0 without input_layernorm).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from worker.tlt.decoding.sampling import RowSampling
from worker.tlt.model.transformer import Transformer
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer, EagleProposerConfig
from worker.tlt.speculative.drafter.export import export_eagle1, export_eagle3, load_exported
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter, Kind
from worker.tlt.speculative.proposers.protocol import DraftContext


def eagle3_table(h: int, inter: int, nh: int, nkv: int, hd: int, vocab: int, dv: int) -> dict[str, tuple]:
    bf = torch.bfloat16
    return {
        "fc.weight": ((h, 3 * h), bf),
        "midlayer.self_attn.q_proj.weight": ((nh * hd, 2 * h), bf),
        "midlayer.self_attn.k_proj.weight": ((nkv * hd, 2 * h), bf),
        "midlayer.self_attn.v_proj.weight": ((nkv * hd, 2 * h), bf),
        "midlayer.self_attn.o_proj.weight": ((h, nh * hd), bf),
        "midlayer.input_layernorm.weight": ((h,), bf),
        "midlayer.hidden_norm.weight": ((h,), bf),
        "midlayer.post_attention_layernorm.weight": ((h,), bf),
        "midlayer.mlp.gate_proj.weight": ((inter, h), bf),
        "midlayer.mlp.up_proj.weight": ((inter, h), bf),
        "midlayer.mlp.down_proj.weight": ((h, inter), bf),
        "norm.weight": ((h,), bf),
        "lm_head.weight": ((dv, h), bf),
        "d2t": ((dv,), torch.int64),
        "t2d": ((vocab,), torch.bool),
    }


def eagle1_table(h: int, inter: int, nh: int, nkv: int, hd: int, vocab: int) -> dict[str, tuple]:
    bf = torch.bfloat16
    return {
        "fc.weight": ((h, 2 * h), bf),
        "fc.bias": ((h,), bf),
        "embed_tokens.weight": ((vocab, h), bf),
        "layers.0.self_attn.q_proj.weight": ((nh * hd, h), bf),
        "layers.0.self_attn.k_proj.weight": ((nkv * hd, h), bf),
        "layers.0.self_attn.v_proj.weight": ((nkv * hd, h), bf),
        "layers.0.self_attn.o_proj.weight": ((h, nh * hd), bf),
        "layers.0.post_attention_layernorm.weight": ((h,), bf),
        "layers.0.mlp.gate_proj.weight": ((inter, h), bf),
        "layers.0.mlp.up_proj.weight": ((inter, h), bf),
        "layers.0.mlp.down_proj.weight": ((h, inter), bf),
    }


def _read(path) -> dict[str, tuple]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: (tuple(f.get_tensor(k).shape), f.get_tensor(k).dtype) for k in f.keys()}  # noqa: SIM118


def _trained_like(target: Transformer, kind: Kind, full_vocab: bool = False) -> EagleDrafter:
    dv = 300 if kind == "eagle3" and not full_vocab else 0
    d = EagleDrafter(target, EagleConfig(kind=kind, draft_vocab_size=dv))
    d.reset_parameters(std=0.1, seed=5)
    if dv:
        counts = torch.arange(target.args.vocab_size).flip(0).float()  # prefers low ids ...
        counts[310] = 1e6  # ... and one high id, so d2t is not all zeros
        d.set_draft_vocab(counts)
    return d


def test_eagle3_export_matches_loader_table(tmp_path, tiny_target: Transformer) -> None:
    a = tiny_target.args
    d = _trained_like(tiny_target, "eagle3")
    out = export_eagle3(d, tmp_path / "e3")
    assert _read(out) == eagle3_table(a.dim, a.intermediate_size, a.n_heads, a.n_kv_heads, a.hd, a.vocab_size, 300)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 300 and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == a.vocab_size and cfg["hidden_size"] == a.dim and cfg["model_type"] == "llama"
    assert cfg["target_hidden_size"] == a.dim and cfg["eagle_config"] == {"use_aux_hidden_state": True}
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                "max_position_embeddings", "hidden_act", "head_dim"):
        assert key in cfg
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    hot = torch.arange(300) + d2t  # the draft ids' target ids, as SGLang's hot_token_id
    assert int(hot[-1]) == 310 and torch.equal(t2d.nonzero().flatten(), hot)


def test_full_vocab_eagle3_export_has_no_vocab_mapping(tmp_path, tiny_target: Transformer) -> None:
    # vLLM creates no draft_id_to_target_id parameter when the vocabularies are equal and fails on a d2t it cannot
    # place; SGLang reads d2t only when present. A reduced vocabulary keeps both (the test above).
    a = tiny_target.args
    out = export_eagle3(_trained_like(tiny_target, "eagle3", full_vocab=True), tmp_path / "e3-full")
    table = eagle3_table(a.dim, a.intermediate_size, a.n_heads, a.n_kv_heads, a.hd, a.vocab_size, a.vocab_size)
    del table["d2t"], table["t2d"]
    assert _read(out) == table
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == a.vocab_size


def test_reload_refuses_a_reduced_vocab_without_its_mapping(tmp_path, tiny_target: Transformer) -> None:
    from safetensors.torch import load_file, save_file

    out = export_eagle3(_trained_like(tiny_target, "eagle3"), tmp_path / "e3")
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["d2t"], tensors["t2d"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="without d2t/t2d has draft_vocab_size 300"):
        load_exported(out, tiny_target)


def test_eagle1_export_matches_loader_table(tmp_path, tiny_target: Transformer) -> None:
    a = tiny_target.args
    d = _trained_like(tiny_target, "eagle1")
    out = export_eagle1(d, tmp_path / "e1")
    assert _read(out) == eagle1_table(a.dim, a.intermediate_size, a.n_heads, a.n_kv_heads, a.hd, a.vocab_size)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"][0] == "LlamaForCausalLMEagle" and "LlamaForCausalLM" in cfg["architectures"]
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] == a.tie_word_embeddings
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert not f.get_tensor("fc.bias").any()
        torch.testing.assert_close(f.get_tensor("embed_tokens.weight"), a_embed(tiny_target))


def a_embed(target: Transformer) -> torch.Tensor:
    return target.model.embed_tokens.weight.detach().to(torch.bfloat16)


def _ctx(hist: list[list[int]], depth: int, nodes: int, temperature: float, topk: int = 1) -> DraftContext:
    b = len(hist)
    return DraftContext(histories=hist, prompt_lens=[3] * b, group_ids=list(range(b)), sample_ids=[0] * b,
                        max_nodes=nodes, max_depth=depth, topk=topk,
                        sampling=RowSampling.uniform(b, temperature=temperature))


@pytest.mark.parametrize(("kind", "full_vocab"), [("eagle1", False), ("eagle3", False), ("eagle3", True)])
def test_export_reload_drafts_identically(tmp_path, tiny_target: Transformer, kind: Kind, full_vocab: bool) -> None:
    d = _trained_like(tiny_target, kind, full_vocab)
    # round the weights to the export dtype first, so "identical" is exact
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    out = (export_eagle3 if kind == "eagle3" else export_eagle1)(d, tmp_path / kind)
    back = load_exported(out, tiny_target)
    assert back.cfg.kind == kind
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    g = torch.Generator().manual_seed(0)
    hist = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (12, 20, 9)]
    feats = [torch.randn(len(h) - 1, d.feature_dim, generator=g) for h in hist]
    for topk, depth, nodes in ((1, 4, 5), (3, 4, 10)):
        props = []
        for drafter in (d, back):
            prop = EagleProposer(drafter, EagleProposerConfig(context=8))
            for b, f in enumerate(feats):
                prop.observe([(b, 0)] * f.shape[0], torch.zeros(f.shape[0]), f)
            props.append(prop.propose(_ctx(hist, depth, nodes, temperature=0.0, topk=topk)))
        a, b2 = props
        assert torch.equal(a.tokens, b2.tokens) and torch.equal(a.parents, b2.parents)
        assert torch.equal(a.counts, b2.counts)
        assert int(a.counts.min()) == nodes  # a full chain / tree per row


def test_export_format_follows_kind_and_rejects_other_forms() -> None:
    from pydantic import ValidationError

    from worker.tlt.config import DrafterConfig

    assert DrafterConfig().export_format is None and DrafterConfig().export_kind == "eagle1"
    assert DrafterConfig(kind="eagle3").export_kind == "eagle3"
    assert DrafterConfig(kind="eagle3", export_format="eagle3").export_kind == "eagle3"
    assert DrafterConfig(kind="ngram").export_kind is None
    with pytest.raises(ValidationError, match="export_format 'eagle3' needs kind 'eagle3'"):
        DrafterConfig(kind="eagle1", export_format="eagle3")
    with pytest.raises(ValidationError, match="needs a learned drafter"):
        DrafterConfig(kind="ngram", export_format="eagle1")


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_export_drafter_writes_the_requested_form(tmp_path, tiny_target: Transformer, kind: Kind) -> None:
    from worker.tlt.speculative.drafter.export import export_drafter

    d = _trained_like(tiny_target, kind)
    cfg = json.loads((export_drafter(d, tmp_path / kind, kind) / "config.json").read_text())
    assert cfg["architectures"][0] == ("LlamaForCausalLMEagle3" if kind == "eagle3" else "LlamaForCausalLMEagle")
    other: Kind = "eagle1" if kind == "eagle3" else "eagle3"
    with pytest.raises(ValueError, match=f"cannot export an {kind} drafter as {other}"):
        export_drafter(d, tmp_path / "other", other)
