"""A GGUF file's metadata and tensors in one pass over its header: struct reads of the header bytes, tensor data
memory-mapped, laid out as the `gguf` package lays it out so that `gguf.dequantize` takes it as is.

The `gguf` package's own reader builds a numpy view per metadata element: seconds for SmolLM2's 49k-token vocabulary
and merges, on every model load. This reader reads the same header in a fraction of a second.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_BOOL, _STRING, _ARRAY = 7, 8, 9
_PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray  # typed for float / int types; rows of quantised blocks (uint8) otherwise, as `gguf` gives them


@dataclass(frozen=True)
class GgufFile:
    fields: dict[str, Any]  # key -> int / float / bool / str, or a list of them
    tensors: list[GgufTensor]


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, n = self.scalar("<I"), self.scalar("<Q")
            if item_type in _SCALARS and item_type != _BOOL:  # numeric arrays in one read (bools stay Python bools)
                dtype = np.dtype(_SCALARS[item_type])
                arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
                self.pos += n * dtype.itemsize
                return arr.tolist()
            return [self.value(item_type) for _ in range(n)]
        if vtype not in _SCALARS:
            raise ValueError(f"GGUF: unknown metadata value type {vtype}")
        return self.scalar(_SCALARS[vtype])


def read_gguf(path: str | Path) -> GgufFile:
    """The metadata (`fields`) and the tensors of a GGUF v2 / v3 file; tensor data stays memory-mapped."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    c.pos = 4
    version = c.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_fields = c.scalar("<Q"), c.scalar("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = c.string()
        fields[key] = c.value(c.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.scalar("<Q") for _ in range(c.scalar("<I")))
        infos.append((name, dims, GGMLQuantizationType(c.scalar("<I")), c.scalar("<Q")))
    align = int(fields.get("general.alignment", 32))
    start = -(-c.pos // align) * align
    data = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, dims, qtype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(dims)) if dims else 1
        raw = data[start + offset : start + offset + n * type_size // block]
        np_shape = tuple(reversed(dims))
        plain = _PLAIN_TYPES.get(qtype.name)
        arr = raw.view(plain).reshape(np_shape) if plain else raw.reshape(quant_shape_to_byte_shape(np_shape, qtype))
        tensors.append(GgufTensor(name, qtype, dims, arr))
    return GgufFile(fields, tensors)
