"""Tokenizers behind one small interface: `Tokenizer` wraps an HF tokenizer (from tokenizer.json / an HF directory or
from a GGUF file through transformers' gguf support); `ByteTokenizer` is the tiny test models' byte-level tokenizer
(ids 0..255 = bytes, 256 = BOS, 257 = EOS, 258 = PAD) with a fixed plain-text chat template.
"""

from __future__ import annotations

import os
from typing import Any, Protocol


class TokenizerLike(Protocol):
    eos_ids: tuple[int, ...]
    pad_id: int
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...


class Tokenizer:
    """An HF tokenizer with the few calls the engine and trainer make."""

    def __init__(self, hf: Any, extra_eos: tuple[int, ...] = ()) -> None:
        self.hf = hf
        eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos]))
        pad = hf.pad_token_id if hf.pad_token_id is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.pad_id: int = int(pad)
        self.vocab_size: int = len(hf)

    @classmethod
    def from_dir(cls, path: str, extra_eos: tuple[int, ...] = ()) -> Tokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), extra_eos)

    @classmethod
    def from_gguf(cls, path: str, extra_eos: tuple[int, ...] = ()) -> Tokenizer:
        # The fast-tokenizer class reads only the tokenizer's metadata; AutoTokenizer first loads the whole file's
        # config through a slow GGUF parse to pick that same class (seconds per load).
        from transformers import PreTrainedTokenizerFast

        d, f = os.path.split(os.path.abspath(path))
        return cls(PreTrainedTokenizerFast.from_pretrained(d, gguf_file=f), extra_eos)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return str(self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt))


class ByteTokenizer:
    """UTF-8 bytes as ids; for tiny random models (vocab >= 259)."""

    BOS, EOS, PAD = 256, 257, 258

    def __init__(self, vocab_size: int = 320) -> None:
        if vocab_size < 259:
            raise ValueError("ByteTokenizer needs vocab_size >= 259")
        self.vocab_size = vocab_size
        self.eos_ids: tuple[int, ...] = (self.EOS,)
        self.pad_id = self.PAD

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")
