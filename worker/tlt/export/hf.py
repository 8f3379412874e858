"""Export the policy as an HF directory that `transformers.AutoModelForCausalLM.from_pretrained` (and vLLM) load:
config.json, model.safetensors, generation_config.json and the tokenizer files.

    export_policy(model, tokenizer, out_dir, dtype=torch.bfloat16, generation={"temperature": 1.0})

Our fused projections are split back into HF's names (`self_attn.{q,k,v}_proj`, `mlp.{gate,up}_proj`; model/hf_names.py
`to_hf`), the other weights keep their names; a tied head is not written (HF ties it from `tie_word_embeddings`). HF
tokenizers are saved with `save_pretrained`; the tiny models' `ByteTokenizer` becomes an equivalent `tokenizers`
byte-level tokenizer (ids 0..255 = bytes, 256/257/258 = <bos>/<eos>/<pad>); tokenizer_config.json is written so that
every transformers the pyproject allows loads it (`_portable_tokenizer_config`). The directory is written under a temporary
name and renamed, so a reader never sees half an export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from worker.tlt.model.hf_names import to_hf
from worker.tlt.model.tokenizer import ByteTokenizer, Tokenizer, TokenizerLike
from worker.tlt.model.transformer import Transformer

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _byte_level_tokenizer_files(tok: ByteTokenizer, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json equivalent to ByteTokenizer (same ids for the same text)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of GPT-2 byte-level BPE
    byte_to_char = _bytes_to_unicode()
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    specials = ["<bos>", "<eos>", "<pad>"]
    hf.add_special_tokens(specials)  # ids 256, 257, 258 in this order
    assert [hf.token_to_id(s) for s in specials] == [tok.BOS, tok.EOS, tok.PAD]
    fast = PreTrainedTokenizerFast(tokenizer_object=hf, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(str(out))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the alphabet of byte-level BPE)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# Keys transformers 5 writes about its own loading state, not the tokenizer; older releases would keep them as kwargs.
_LOADER_STATE_KEYS = ("backend", "is_local", "local_files_only")


def _portable_tokenizer_config(out: Path) -> None:
    """Make tokenizer_config.json load on every transformers the pyproject allows (>= 4.45), not only the one that
    wrote it: transformers 5 names its own `TokenizersBackend` class (unknown before 5) and puts the chat template in
    a separate chat_template.jinja (read only by newer releases). `PreTrainedTokenizerFast` over tokenizer.json is the
    same tokenizer on every version; the template goes inline, where all of them read it."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in _LOADER_STATE_KEYS:
        config.pop(key, None)
    template = out / "chat_template.jinja"
    if template.exists():
        config["chat_template"] = template.read_text()
        template.unlink()
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def save_tokenizer(tokenizer: TokenizerLike, out: Path) -> None:
    if isinstance(tokenizer, Tokenizer):
        tokenizer.hf.save_pretrained(str(out))
    elif isinstance(tokenizer, ByteTokenizer):
        _byte_level_tokenizer_files(tokenizer, out)
    else:
        raise TypeError(f"cannot export tokenizer of type {type(tokenizer).__name__}")
    _portable_tokenizer_config(out)


def export_policy(
    model: Transformer,
    tokenizer: TokenizerLike,
    out_dir: Path,
    dtype: torch.dtype | None = None,  # None = the model's own dtype
    generation: dict[str, Any] | None = None,  # extra generation_config.json fields (temperature, top_p, ...)
) -> Path:
    """Write the HF directory at out_dir (replacing an older export there). Returns out_dir."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    dt = dtype or model.head_weight.dtype
    args = model.args
    config = args.to_hf_config()
    config["torch_dtype"] = _DTYPE_NAMES[dt]
    eos = list(args.eos_token_ids) or list(tokenizer.eos_ids)
    if eos:
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    config["pad_token_id"] = tokenizer.pad_id
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    on_host = {k: v.detach().to("cpu", dt) for k, v in model.state_dict().items()}  # split on the host, not the GPU
    weights = {k: v.clone().contiguous() for k, v in to_hf(on_host, args).items()}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    gen: dict[str, Any] = {"eos_token_id": config.get("eos_token_id"), "pad_token_id": tokenizer.pad_id}
    if args.bos_token_id is not None:
        gen["bos_token_id"] = args.bos_token_id
    gen.update(generation or {})
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    save_tokenizer(tokenizer, tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
