"""Export the drafter as an HF-style directory that vLLM and SGLang serve, and load such a directory back.

Names and shapes follow the public loaders (read, not copied):
- EAGLE-3 (vLLM `vllm/model_executor/models/llama_eagle3.py`, SGLang `python/sglang/srt/models/llama_eagle3.py`):
  config `architectures: ["LlamaForCausalLMEagle3"]` (a name both registries map to their EAGLE-3 Llama drafter, also
  for Qwen targets), `num_hidden_layers: 1`, `draft_vocab_size`, `tie_word_embeddings: false`,
  `eagle_config.use_aux_hidden_state: true` (vLLM: fc present); weights `fc.weight [H, 3H]`,
  `midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]`, `midlayer.self_attn.o_proj.weight`,
  `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
  `norm.weight`, `lm_head.weight [draft_vocab, H]`; with a reduced draft vocabulary also `d2t [draft_vocab] int64`
  (target id - draft id) and `t2d [V] bool` (a full-vocabulary drafter writes neither: vLLM fails on them).
  Our fused `qkv_proj` / `gate_up_proj` are written under these HF names (model/hf_names.py `to_hf`); loading back
  fuses them again (the drafter's `load_state_dict` takes HF names). Feature layers are the loaders' defaults (hidden
  states entering target layers 2, L//2, L-3), so no layer ids are written (vLLM and SGLang read explicit ids with
  different offsets).
- EAGLE-1 (vLLM `vllm/model_executor/models/llama_eagle.py`, SGLang `python/sglang/srt/models/llama_eagle.py`):
  `fc.weight [H, 2H]`, `fc.bias [H]` (zeros: SGLang's fc has a bias, vLLM skips the name), `layers.0.*` without
  `input_layernorm`, `embed_tokens.weight` (the target's; both engines share the target's at load); no lm_head (both
  use the target's). `architectures: ["LlamaForCausalLMEagle", "LlamaForCausalLM"]`: SGLang takes the first;
  vLLM prefixes "Eagle" to each and takes the first it registers (`EagleLlamaForCausalLM`).

    export_drafter(drafter, out_dir, fmt=spec.drafter.export_kind)    # or export_eagle3 / export_eagle1
    drafter = load_exported(out_dir, target)
Run the tests: `python -m pytest tests/drafter/test_drafter_export.py -q`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from worker.tlt.model.hf_names import to_hf
from worker.tlt.model.transformer import Transformer
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter, Kind

_LAYER_PARTS = ("self_attn.", "input_layernorm.", "hidden_norm.", "post_attention_layernorm.", "mlp.")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _base_config(drafter: EagleDrafter, dtype: torch.dtype) -> dict[str, Any]:
    cfg = drafter.args.to_hf_config()
    cfg.update(model_type="llama", num_hidden_layers=1, torch_dtype=_DTYPE_NAMES[dtype], attention_bias=False,
               mlp_bias=False)
    return cfg


def _write(out_dir: Path | str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def eagle3_form(drafter: EagleDrafter, dtype: torch.dtype = torch.bfloat16
                ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) of the EAGLE-3 export, in memory (the vLLM rollout reloads its drafter from them)."""
    if drafter.cfg.kind != "eagle3":
        raise ValueError("export_eagle3 needs an EAGLE-3 drafter (EagleConfig(kind='eagle3'))")
    cfg = _base_config(drafter, dtype)
    cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=drafter.draft_vocab_size,
        target_hidden_size=drafter.args.dim,
        tie_word_embeddings=False,
        eagle_config={"use_aux_hidden_state": True},
    )
    # A full-vocabulary drafter's mapping is the identity, and vLLM has no mapping parameter for it (it still renames
    # d2t to one, so the load fails): only a reduced draft vocabulary writes d2t / t2d. SGLang treats both the same.
    reduced_vocab = drafter.draft_vocab_size != drafter.target.args.vocab_size
    tensors: dict[str, torch.Tensor] = {}
    for name, t in to_hf(drafter.state_dict(), drafter.args).items():
        if name in ("d2t", "t2d"):
            if reduced_vocab:
                tensors[name] = t.to(torch.int64 if name == "d2t" else torch.bool)
        elif name.startswith(_LAYER_PARTS):
            tensors["midlayer." + name] = t.to(dtype)
        else:  # fc, norm, lm_head
            tensors[name] = t.to(dtype)
    return cfg, tensors


def eagle1_form(drafter: EagleDrafter, dtype: torch.dtype = torch.bfloat16
                ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) of the EAGLE-1 export, in memory."""
    if drafter.cfg.kind != "eagle1":
        raise ValueError("export_eagle1 needs an EAGLE-1 drafter (EagleConfig(kind='eagle1'))")
    cfg = _base_config(drafter, dtype)
    cfg.update(architectures=["LlamaForCausalLMEagle", "LlamaForCausalLM"],
               tie_word_embeddings=drafter.target.args.tie_word_embeddings)
    tensors = {
        ("layers.0." + n if n.startswith(_LAYER_PARTS) else n): t.to(dtype)
        for n, t in to_hf(drafter.state_dict(), drafter.args).items()
    }
    tensors["fc.bias"] = torch.zeros(drafter.args.dim, dtype=dtype)
    tensors["embed_tokens.weight"] = drafter.embed_weight.detach().to(dtype)
    return cfg, tensors


def export_eagle3(drafter: EagleDrafter, out_dir: Path | str, dtype: torch.dtype = torch.bfloat16) -> Path:
    return _write(out_dir, *eagle3_form(drafter, dtype))


def export_eagle1(drafter: EagleDrafter, out_dir: Path | str, dtype: torch.dtype = torch.bfloat16) -> Path:
    return _write(out_dir, *eagle1_form(drafter, dtype))


def load_exported(
    path: Path | str,
    target: Transformer,  # the target whose embedding (and EAGLE-1 head) the drafter shares
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,  # parameter dtype of the loaded drafter
    ttt_steps: int = 1,  # training-time-test steps if the drafter is trained further
) -> EagleDrafter:
    """Our engine's drafter from an `export_eagle3` / `export_eagle1` directory (or a public one of the same form)."""
    from safetensors.torch import load_file

    p = Path(path)
    cfg = json.loads((p / "config.json").read_text())
    archs = cfg.get("architectures", [])
    kind: Kind = "eagle3" if "LlamaForCausalLMEagle3" in archs else "eagle1"
    if cfg.get("hidden_size") != target.args.dim:
        raise ValueError(f"drafter hidden_size {cfg.get('hidden_size')} != target's {target.args.dim}")
    sd = load_file(str(p / "model.safetensors"))
    ecfg = EagleConfig(kind=kind, draft_vocab_size=int(cfg.get("draft_vocab_size") or 0) if kind == "eagle3" else 0,
                       ttt_steps=ttt_steps)
    drafter = EagleDrafter(target, ecfg)
    ours: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name in ("embed_tokens.weight", "fc.bias"):
            if name == "fc.bias" and bool(t.float().abs().max() > 0):
                raise ValueError("EAGLE-1 fc.bias is nonzero; our drafter's fc has no bias")
            continue
        key = name.removeprefix("midlayer.").removeprefix("layers.0.")
        ours[key] = t
    if kind == "eagle3" and "d2t" not in ours:  # a full-vocabulary export: the identity mapping
        if drafter.draft_vocab_size != target.args.vocab_size:
            raise ValueError(f"EAGLE-3 drafter without d2t/t2d has draft_vocab_size {drafter.draft_vocab_size}, "
                             f"not the target's vocabulary {target.args.vocab_size}")
        ours["d2t"], ours["t2d"] = drafter.d2t, drafter.t2d
    drafter.load_state_dict(ours, strict=True)
    dev = device if device is not None else target.head_weight.device
    drafter.to(device=dev, dtype=dtype)
    if kind == "eagle3":  # the index buffers keep their integer / bool dtypes
        drafter.d2t = ours["d2t"].to(dev, torch.int64)
        drafter.t2d = ours["t2d"].to(dev, torch.bool)
    return drafter.eval()


def export_drafter(drafter: EagleDrafter, out_dir: Path | str, fmt: Kind | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> Path:
    """Export in `fmt` (a job's `drafter.export_format`; None = the drafter's own form). A drafter exports only in
    its own form: the EAGLE-1 and EAGLE-3 layers read different features, so no conversion is attempted."""
    kind = fmt or drafter.cfg.kind
    if kind != drafter.cfg.kind:
        raise ValueError(f"cannot export an {drafter.cfg.kind} drafter as {kind}")
    export = export_eagle3 if kind == "eagle3" else export_eagle1
    return export(drafter, out_dir, dtype)
