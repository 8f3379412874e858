"""Which files a job spec may name by path: only those inside the directories the operator lists in TLT_SPEC_ROOTS,
and never inside the service's own home or artifact store (other users' weights, uploads, the database).

The API checks at submit and the worker again before it loads anything (its own settings decide: the roots are a
fact of the machine that reads the files). A path is judged by its realpath, so `..` and symlinks cannot leave a root;
the worker's loaders then judge every file they open the same way (worker/tlt/file_guard.py: links inside a named
directory, hard links).
The refusal text is the same whether or not the path exists, so the check cannot be used to probe the worker's disk.

    refused = spec_path_errors(spec, settings.spec_root_paths, settings.private_dirs)   # [(loc, message), ...]
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from worker.tlt.config import JobSpec
from worker.tlt.file_guard import path_allowed

REFUSED = ("path not allowed: a spec may name only absolute paths inside the directories the operator lists in "
           "TLT_SPEC_ROOTS (use a built-in, an uploaded dataset_id or an artifact_id instead)")


def spec_paths(spec: JobSpec) -> Iterator[tuple[tuple[str, ...], str]]:
    """Every filesystem path the spec names, with its location in the spec."""
    for loc, value in ((("model", "hf_dir"), spec.model.hf_dir), (("model", "gguf"), spec.model.gguf),
                       (("dataset", "path"), spec.dataset.path), (("drafter", "warm_start"), spec.drafter.warm_start)):
        if isinstance(value, str):
            yield loc, value


def spec_path_errors(spec: JobSpec, roots: tuple[Path, ...],
                     private: tuple[Path, ...]) -> list[tuple[tuple[str, ...], str]]:
    """(location, message) of each path in the spec that may not be read; empty when all are allowed."""
    return [(loc, REFUSED) for loc, path in spec_paths(spec) if not path_allowed(path, roots, private)]
