"""HF export: the tiny Llama / Qwen2 / Qwen3 policies written by export_policy load with
transformers.AutoModelForCausalLM.from_pretrained and give the same logits; the byte tokenizer's export encodes and
decodes like ByteTokenizer.

Run: python -m pytest tests/train/test_train_export_hf.py -q
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.tlt.config import ModelSource
from worker.tlt.export.hf import export_policy
from worker.tlt.model.load import load_model


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_export_loads_in_transformers_with_matching_logits(name: str, tmp_path: Path) -> None:
    model, tok = load_model(ModelSource(builtin=name))
    with torch.no_grad():  # move the weights off their random init so a wrong tie or name would show
        model.model.norm.weight.mul_(1.5)
    out = export_policy(model, tok, tmp_path / "policy", generation={"temperature": 0.7})
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    assert json.loads((out / "generation_config.json").read_text())["temperature"] == 0.7
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([tok.encode("Write the letter a many times: aaa", add_special_tokens=True)])
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    hf_tok = AutoTokenizer.from_pretrained(out)
    text = "héllo, wörld!"
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf_tok.decode(tok.encode(text)) == text
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id) == (tok.EOS, tok.PAD)
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())
