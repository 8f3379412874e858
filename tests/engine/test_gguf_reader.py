"""Our GGUF reader gives what the `gguf` package's reader gives: every metadata value and every tensor's bytes, on a
file written by `gguf`'s own writer with each value type and plain and quantised tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, dequantize, quantize

from worker.tlt.model.gguf_reader import read_gguf


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 3)
    w.add_int32("x.i32", -7)
    w.add_uint64("x.u64", 2**40)
    w.add_float32("x.f32", 1e-5)
    w.add_float64("x.f64", 0.1)
    w.add_bool("x.bool", True)
    w.add_string("x.str", "héllo ✓")
    w.add_array("x.strings", ["a", "", "Ġthe", "<|im_end|>"])
    w.add_array("x.ints", [3, 1, 4, 1, 5])
    w.add_key_value("x.floats", [0.5, -2.0], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    q = quantize(rng.standard_normal((2, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_fields_match_gguf_reader(gguf_file: Path) -> None:
    ours, theirs = read_gguf(gguf_file), GGUFReader(str(gguf_file))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert ours.fields["x.strings"] == ["a", "", "Ġthe", "<|im_end|>"] and ours.fields["x.u64"] == 2**40


def test_tensors_match_gguf_reader(gguf_file: Path) -> None:
    ours, theirs = read_gguf(gguf_file), GGUFReader(str(gguf_file))
    assert [t.name for t in ours.tensors] == ["f32", "f16", "q8"]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(int(d) for d in b.shape))
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
    q8 = ours.tensors[2]
    assert dequantize(q8.data, q8.tensor_type).shape == (2, 64)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(bad)


def test_smollm2_tokenizer_matches_autotokenizer() -> None:
    """The GGUF tokenizer comes from the fast-tokenizer class directly (no whole-file config parse): it must be the
    tokenizer AutoTokenizer resolves for the file, on chat templates and on awkward text."""
    from transformers import AutoTokenizer

    from worker.tlt.model.gguf import smollm2_gguf_path
    from worker.tlt.model.tokenizer import Tokenizer

    path = smollm2_gguf_path()
    ours = Tokenizer.from_gguf(str(path))
    auto = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcödé  spaces\n\n12,345.6 ✓"}]
    assert ours.apply_chat_template(chat) == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    for text in (ours.apply_chat_template(chat), "  leading and trailing  ", "x" * 300, "<|im_end|>\n<|im_start|>"):
        assert ours.encode(text) == auto.encode(text, add_special_tokens=False)
    assert (ours.eos_ids[0], ours.pad_id, ours.vocab_size) == (auto.eos_token_id, auto.pad_token_id, len(auto))
