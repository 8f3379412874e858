"""The exported policy loads on the oldest transformers the pyproject allows (4.45, the floor lane: scripts/lanes.sh
hf-floor) as well as on the installed one: its tokenizer config names a class every release has
(`PreTrainedTokenizerFast`, not transformers 5's `TokenizersBackend`) with the chat template inline; the floor's
tokenizer encodes and templates like ours and its model gives our logits.

Run: python -m pytest tests/vllm/test_export_transformers_floor.py -q   (builds .lanes/hf-floor once, ~30 s)
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tests.vllm.lanes import REPO, ensure_lane, run_helper
from worker.tlt.config import ModelSource
from worker.tlt.export.hf import export_policy, save_tokenizer
from worker.tlt.model.gguf import smollm2_gguf_path
from worker.tlt.model.load import load_model
from worker.tlt.model.tokenizer import ByteTokenizer, Tokenizer
from worker.tlt.model.transformer import Transformer

TEXT = "héllo, wörld! 12 + 30 = 42"
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


@dataclass
class Exports:
    policy: Path  # a tiny Llama policy with the byte tokenizer
    smollm2: Path  # SmolLM2's tokenizer (with its chat template) as a policy export writes it
    model: Transformer
    byte_tok: ByteTokenizer


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Exports:
    root = tmp_path_factory.mktemp("floor")
    model, byte_tok = load_model(ModelSource(builtin="tiny-llama"))
    assert isinstance(byte_tok, ByteTokenizer)
    with torch.no_grad():  # off the random init, so a wrong tie or name would show
        model.model.norm.weight.mul_(1.5)
    save_tokenizer(Tokenizer.from_gguf(str(smollm2_gguf_path())), root / "smollm2")
    return Exports(export_policy(model, byte_tok, root / "policy"), root / "smollm2", model, byte_tok)


@pytest.mark.parametrize("name", ["policy", "smollm2"])
def test_tokenizer_config_names_a_class_every_release_has(exports: Exports, name: str) -> None:
    out: Path = getattr(exports, name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert not {"backend", "is_local", "local_files_only"} & cfg.keys()
    assert not (out / "chat_template.jinja").exists()
    tok = AutoTokenizer.from_pretrained(out)  # the installed transformers
    if name == "smollm2":
        ours = Tokenizer.from_gguf(str(smollm2_gguf_path()))
        assert cfg["chat_template"] == ours.hf.chat_template
        assert tok.encode(TEXT, add_special_tokens=False) == ours.encode(TEXT)
        chat = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert chat == ours.apply_chat_template(MESSAGES)
    else:
        assert tok.encode(TEXT, add_special_tokens=False) == exports.byte_tok.encode(TEXT)


def test_exports_load_on_the_transformers_floor(exports: Exports, tmp_path: Path) -> None:
    floor = ensure_lane("hf-floor")
    byte_tok, model = exports.byte_tok, exports.model
    ids = byte_tok.encode("Write the letter a many times: aaa", add_special_tokens=True)
    got = run_helper(
        sys.executable, "hf_floor_load.py",
        {"tokenizers": {"policy": str(exports.policy), "smollm2": str(exports.smollm2)}, "text": TEXT,
         "messages": MESSAGES, "policy": str(exports.policy), "ids": ids},
        tmp_path, "HF_FLOOR", extra_env={"PYTHONPATH": f"{floor}:{REPO}"}, timeout=600,
    )
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"transformers>={got["version"].rsplit(".", 1)[0]}' in pyproject, got["version"]  # the floor itself
    smol, policy = got["tokenizers"]["smollm2"], got["tokenizers"]["policy"]
    ours = Tokenizer.from_gguf(str(smollm2_gguf_path()))
    assert smol["class"] == policy["class"] == "PreTrainedTokenizerFast"
    assert smol["ids"] == ours.encode(TEXT) and smol["chat"] == ours.apply_chat_template(MESSAGES)
    assert policy["ids"] == byte_tok.encode(TEXT) and policy["eos_pad"] == [byte_tok.EOS, byte_tok.PAD]
    with torch.no_grad():
        expected = model(torch.tensor([ids]))[0]
    torch.testing.assert_close(torch.tensor(got["logits"]), expected, atol=1e-5, rtol=0)
