"""Our EAGLE-3 export against what SGLang's EAGLE-3 loader reads. SGLang cannot run here, so the names are pinned
from its released source (sgl-project/sglang python/sglang/srt/models/llama_eagle3.py, read at commit 03d5a77):

- `architectures: ["LlamaForCausalLMEagle3"]` is its entry class; config fields it reads: hidden_size,
  target_hidden_size (fc input = 3 x it), intermediate_size, num_hidden_layers (1: the midlayer alone),
  num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, hidden_act, vocab_size, draft_vocab_size (None
  would take the target's head instead of ours), tie_word_embeddings (false: its own lm_head), bias (fc bias; absent
  = none), model_type (not llama4_text).
- Its parameters: model.fc.weight [H, 3H]; model.midlayer.self_attn.qkv_proj (q, k, v stacked, input 2H),
  model.midlayer.self_attn.o_proj, model.midlayer.mlp.gate_up_proj (gate, up stacked), model.midlayer.mlp.down_proj,
  model.midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}, model.norm, lm_head [draft_vocab, H];
  model.embed_tokens comes from the target. A checkpoint name is tried as given, then under `model.`; a `q_proj` /
  `k_proj` / `v_proj` / `gate_proj` / `up_proj` name loads into its stacked parameter. A name that matches no
  parameter is dropped SILENTLY, so a wrong name would leave a random weight: the test checks every parameter gets
  its tensors and every tensor a parameter.
- `d2t` (optional) becomes its hot-token map, draft id + d2t; `t2d` is skipped.

Run: python -m pytest tests/vllm/test_sglang_eagle3_names.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from worker.tlt.model import preset, random_model
from worker.tlt.speculative.drafter.export import export_eagle3
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter

ENTRY_CLASS = "LlamaForCausalLMEagle3"
CONFIG_READ = ("hidden_size", "target_hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "vocab_size", "draft_vocab_size",
               "tie_word_embeddings", "model_type")
# checkpoint part -> (stacked parameter part, shard); SGLang's own list of stacked projections
STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
           ".gate_proj": (".gate_up_proj", "gate"), ".up_proj": (".gate_up_proj", "up")}
SKIPPED = {"t2d"}
HOT_MAP = "d2t"


def sglang_parameters(cfg: dict) -> dict[str, dict[str, tuple[int, ...]]]:
    """SGLang's EAGLE-3 parameters for this config, each with the shards it is loaded from (name -> shard -> shape)
    - `""` is the whole tensor. The target's embedding is left out: SGLang takes it from the target."""
    h, th, inter = cfg["hidden_size"], cfg["target_hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    mid = "model.midlayer."
    params = {
        "model.fc.weight": {"": (h, 3 * th)},
        mid + "self_attn.qkv_proj.weight": {"q": (q, 2 * h), "k": (kv, 2 * h), "v": (kv, 2 * h)},
        mid + "self_attn.o_proj.weight": {"": (h, q)},
        mid + "mlp.gate_up_proj.weight": {"gate": (inter, h), "up": (inter, h)},
        mid + "mlp.down_proj.weight": {"": (h, inter)},
        mid + "input_layernorm.weight": {"": (h,)},
        mid + "hidden_norm.weight": {"": (h,)},
        mid + "post_attention_layernorm.weight": {"": (h,)},
        "model.norm.weight": {"": (h,)},
        "lm_head.weight": {"": (cfg["draft_vocab_size"], h)},
    }
    if cfg.get("bias", False):
        params["model.fc.bias"] = {"": (h,)}
    return params


def sglang_destination(name: str, params: dict) -> tuple[str, str] | None:
    """Where SGLang's loader puts checkpoint tensor `name`: (parameter, shard), or None when it drops it."""
    shard = ""
    for part, (stacked, part_shard) in STACKED.items():
        if part in name:
            name, shard = name.replace(part, stacked), part_shard
            break
    for candidate in (name, f"model.{name}"):
        if candidate in params:
            return candidate, shard
    return None


def _exported(tmp_path: Path, draft_vocab: int) -> tuple[dict, dict[str, torch.Tensor]]:
    target = random_model(preset("tiny-llama", n_layers=4), seed=1)
    d = EagleDrafter(target, EagleConfig(kind="eagle3", draft_vocab_size=draft_vocab))
    if draft_vocab:
        d.set_draft_vocab(torch.arange(target.args.vocab_size).flip(0).float())
    out = export_eagle3(d, tmp_path / "e3")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return json.loads((out / "config.json").read_text()), tensors


@pytest.mark.parametrize("draft_vocab", [0, 200], ids=["full-vocab", "reduced-vocab"])
def test_every_sglang_parameter_gets_our_tensors(tmp_path: Path, draft_vocab: int) -> None:
    cfg, tensors = _exported(tmp_path, draft_vocab)
    assert cfg["architectures"][0] == ENTRY_CLASS
    missing = [k for k in CONFIG_READ if k not in cfg]
    assert not missing, missing
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False and cfg["model_type"] != "llama4_text"
    assert cfg["draft_vocab_size"] == (draft_vocab or cfg["vocab_size"])  # set: never the target's head
    params = sglang_parameters(cfg)
    loaded: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, t in tensors.items():
        if name in SKIPPED or name == HOT_MAP:
            continue
        dest = sglang_destination(name, params)
        assert dest is not None, f"SGLang would drop {name}"
        param, shard = dest
        assert shard not in loaded.setdefault(param, {}), f"{param}[{shard}] written twice"
        loaded[param][shard] = tuple(t.shape)
    assert loaded == params


def test_sglang_hot_tokens_are_our_draft_vocabulary(tmp_path: Path) -> None:
    _, tensors = _exported(tmp_path, 200)
    hot = tensors[HOT_MAP] + torch.arange(tensors[HOT_MAP].shape[0])  # SGLang's hot_token_id
    assert hot.tolist() == tensors["t2d"].nonzero().flatten().tolist()  # the draft ids' target ids, in order
    _, full = _exported(tmp_path / "full", 0)
    assert HOT_MAP not in full  # a full vocabulary: no map, SGLang drafts over the whole vocabulary
