"""Which files a job may open on its spec's behalf: every file a loader opens (an HF directory's config, safetensors
and tokenizer files, a GGUF file, a drafter's warm-start directory, a dataset file) must itself resolve inside the
allowed roots and outside the private directories (the service's home and artifact store), not just the directory
the spec named: a directory inside a root may hold links that lead elsewhere.

- symlinks (to files or directories, at any depth) are followed and judged by their realpath; one that leaves the
  roots is refused. (An HF cache snapshot, all symlinks into `../../blobs`, passes when the blobs are inside a root.)
- a regular file with more than one hard link is refused: a hard link has no "real" path to judge, and one made
  beside another user's exported weights would read them. Copy such files instead of linking them.
- `trusted` paths (the uploads and artifacts the spec named by id, resolved by the service) are readable although
  they lie in the artifact store.

The service installs a guard in the job's process before the library loads anything (`install`); the library's
loaders ask `current()`, which without one (the library run on its own, `tlt train spec.yaml`) allows everything.

    guard = FileGuard(roots=(Path("/data"),), private=(Path("/srv/tlt"),))
    real = guard.file("/data/m/model.safetensors")   # the realpath to open, or UnsafeFile with the reason
    guard.tree("/data/m")                            # every entry under the directory, at any depth
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

MAX_TREE_ENTRIES = 100_000  # entries checked under one directory before it is refused as too large to vet


class UnsafeFile(PermissionError):
    """A file the job may not open, with the reason (the attempt fails with it)."""


def inside(real: Path, dirs: tuple[Path, ...]) -> bool:
    return any(real == d or real.is_relative_to(d) for d in dirs)


def path_allowed(path: str | Path, roots: tuple[Path, ...], private: tuple[Path, ...]) -> bool:
    """True when `path` is absolute and its realpath lies inside a root and outside every private directory."""
    if not os.path.isabs(path) or "\x00" in str(path):
        return False
    real = Path(os.path.realpath(path))
    return not inside(real, private) and inside(real, roots)


@dataclass(frozen=True)
class FileGuard:
    roots: tuple[Path, ...]  # realpaths of the directories a spec may read from
    private: tuple[Path, ...]  # realpaths never readable through a spec path
    trusted: tuple[Path, ...] = ()  # realpaths the service resolved for this job (its own uploads and artifacts)
    enforce: bool = True  # False: the library on its own (no service, no other users): everything is allowed

    def _judge(self, path: str | Path) -> Path:
        real = Path(os.path.realpath(path))
        if not self.enforce or inside(real, self.trusted):
            return real
        if inside(real, self.private):
            raise UnsafeFile(f"{path} leads into the service's own storage ({real}); a spec may read only files "
                             "inside TLT_SPEC_ROOTS (name your own uploads and artifacts by id)")
        if not inside(real, self.roots):
            raise UnsafeFile(f"{path} resolves to {real}, outside the directories in TLT_SPEC_ROOTS "
                             "(a link inside an allowed directory may not lead out of it)")
        return real

    def _single_link(self, path: str | Path, real: Path) -> None:
        st = os.stat(real)
        if self.enforce and stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and not inside(real, self.trusted):
            raise UnsafeFile(f"{path} is a hard-linked file ({st.st_nlink} links); copy it instead of linking it "
                             "(a hard link cannot be told apart from another user's file)")

    def file(self, path: str | Path) -> Path:
        """The realpath of `path` to open, if the job may open it; else UnsafeFile."""
        real = self._judge(path)
        if real.exists():  # a missing file fails in its loader with its own error
            self._single_link(path, real)
        return real

    def tree(self, path: str | Path) -> Path:
        """The realpath of directory `path` after every entry under it (following links, at any depth) passed
        `file`: for readers that open files of a directory by themselves (AutoTokenizer, safetensors)."""
        root = self._judge(path)
        if not self.enforce:
            return root
        seen: set[Path] = set()
        todo, checked = [root], 0
        while todo:
            d = todo.pop()
            if d in seen or not d.is_dir():
                continue
            seen.add(d)
            for entry in os.scandir(d):
                checked += 1
                if checked > MAX_TREE_ENTRIES:
                    raise UnsafeFile(f"{path} holds more than {MAX_TREE_ENTRIES} entries; name a smaller directory")
                real = self.file(Path(d) / entry.name)
                if real.is_dir():
                    todo.append(real)
        return root


UNGUARDED = FileGuard(roots=(), private=(), enforce=False)
_installed: FileGuard | None = None


def install(guard: FileGuard | None) -> None:
    """Make `guard` the one every loader in this process asks (None: back to unguarded)."""
    global _installed
    _installed = guard


def current() -> FileGuard:
    return _installed if _installed is not None else UNGUARDED
