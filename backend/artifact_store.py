"""Byte layout of a downloadable artifact: a file is itself; a directory is a canonical tar stream (sorted entries,
mtime 0, uid/gid 0, GNU format) built on the fly, so its size and sha256 are fixed at registration and the download
can be resumed with Range requests. No file is read into memory whole.

    python -c "from backend.artifact_store import digest; print(digest('runs/1/policy'))"
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20  # bytes read per yield
BLOCK = tarfile.BLOCKSIZE  # 512


@dataclass(frozen=True)
class Segment:
    size: int
    data: bytes | None = None  # literal bytes (tar headers, padding) ...
    path: Path | None = None  # ... or the whole of this file


def _tar_header(name: str, size: int, is_dir: bool) -> bytes:
    info = tarfile.TarInfo(name + ("/" if is_dir else ""))
    info.size = 0 if is_dir else size
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.mode = 0o755 if is_dir else 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")


def layout(path: Path) -> list[Segment]:
    """The segments whose concatenation is the download of `path` (symlinks inside a directory are skipped)."""
    path = Path(path)
    if path.is_file():
        return [Segment(size=path.stat().st_size, path=path)]
    if not path.is_dir():
        raise FileNotFoundError(path)
    segs: list[Segment] = []
    top = path.name
    for root, dirs, files in os.walk(path):
        dirs.sort()
        rel_root = Path(root).relative_to(path)
        base = top if str(rel_root) == "." else f"{top}/{rel_root.as_posix()}"
        head = _tar_header(base, 0, True)
        segs.append(Segment(size=len(head), data=head))
        for fname in sorted(files):
            fpath = Path(root) / fname
            if fpath.is_symlink() or not fpath.is_file():
                continue
            size = fpath.stat().st_size
            head = _tar_header(f"{base}/{fname}", size, False)
            segs.append(Segment(size=len(head), data=head))
            segs.append(Segment(size=size, path=fpath))
            if size % BLOCK:
                segs.append(Segment(size=BLOCK - size % BLOCK, data=b"\0" * (BLOCK - size % BLOCK)))
    segs.append(Segment(size=2 * BLOCK, data=b"\0" * (2 * BLOCK)))  # end-of-archive marker
    return segs


def total_size(segs: list[Segment]) -> int:
    return sum(s.size for s in segs)


def iter_bytes(segs: list[Segment], start: int = 0, end: int | None = None) -> Iterator[bytes]:
    """Bytes [start, end] (inclusive, as in an HTTP Range) of the concatenated segments, in chunks."""
    end = total_size(segs) - 1 if end is None else end
    offset = 0
    for seg in segs:
        lo, hi = max(start, offset), min(end, offset + seg.size - 1)
        if lo <= hi:
            if seg.data is not None:
                yield seg.data[lo - offset : hi - offset + 1]
            else:
                assert seg.path is not None
                with open(seg.path, "rb") as f:
                    f.seek(lo - offset)
                    left = hi - lo + 1
                    while left > 0:
                        chunk = f.read(min(CHUNK, left))
                        if not chunk:
                            raise OSError(f"{seg.path} shrank while being read")
                        left -= len(chunk)
                        yield chunk
        offset += seg.size
        if offset > end:
            return


def digest(path: str | Path) -> tuple[int, str, bool]:
    """(size, sha256 hex, is_dir) of exactly what downloading `path` returns."""
    path = Path(path)
    segs = layout(path)
    h = hashlib.sha256()
    for chunk in iter_bytes(segs):
        h.update(chunk)
    return total_size(segs), h.hexdigest(), path.is_dir()


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """One `bytes=a-b` / `bytes=a-` / `bytes=-n` range -> (start, end) inclusive; None = whole body.
    Raises ValueError when unsatisfiable (HTTP 416). Multi-range requests get the whole body (allowed by RFC 9110)."""
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, _, last = spec.strip().partition("-")
    try:
        if first == "":
            n = int(last)
            if n <= 0:
                raise ValueError("empty suffix range")
            return max(0, size - n), size - 1
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError as e:
        raise ValueError(f"bad Range header {header!r}") from e
    if start >= size or end < start:
        raise ValueError(f"range {header!r} not satisfiable for {size} bytes")
    return start, min(end, size - 1)
