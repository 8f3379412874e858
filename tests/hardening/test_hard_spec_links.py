"""Links inside an allowed root: every file the worker opens for a spec must itself resolve inside TLT_SPEC_ROOTS and
outside the service's home and artifact store. The attack: user B makes `/r/allowed/m/` whose files are symlinks
(or a nested symlinked directory, or hard links) to user A's exported policy in the artifact store, and names
`model: {hf_dir: /r/allowed/m}`; the directory itself passes the realpath check, and the loaders used to follow the
links and train on A's weights. Now the HF loader, the GGUF loader, the drafter warm start and the dataset loader
refuse with the reason, under the guard the job process installs (worker/tlt/file_guard.py, backend/worker_spec.py).

Run: python -m pytest tests/hardening/test_hard_spec_links.py -q
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backend.core.config import Settings
from backend.worker_spec import job_file_guard
from worker.tlt import file_guard
from worker.tlt.config import DatasetSource, JobSpec, ModelSource
from worker.tlt.data.dataset import load_examples
from worker.tlt.file_guard import FileGuard, UnsafeFile
from worker.tlt.model.load import load_hf_state_dict, load_model
from worker.tlt.speculative.drafter.online import build_drafter
from worker.tlt.speculative.drafter.online_config import OnlineDrafterConfig

WEIGHTS = {"model.embed_tokens.weight": torch.arange(6.0).reshape(2, 3)}  # "alice's" tensor


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Settings, Path, Path]]:
    """(settings with TLT_SPEC_ROOTS=<tmp>/r, alice's exported policy in the artifact store, bob's dir in the root);
    the job's guard installed as the job process installs it, removed after."""
    settings = Settings(home=tmp_path / "home", spec_roots=str(tmp_path / "r"))
    theirs = settings.artifacts / "jobs" / "1" / "policy"
    theirs.mkdir(parents=True)
    (theirs / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    save_file(WEIGHTS, str(theirs / "model.safetensors"))
    (theirs / "rows.jsonl").write_text('{"question": "secret", "answer": "1"}\n')
    mine = tmp_path / "r" / "allowed" / "m"
    mine.mkdir(parents=True)
    spec = JobSpec.model_validate({"model": {"hf_dir": str(mine)}, "dataset": {"builtin": "toy-count"}})
    file_guard.install(job_file_guard(spec, settings))
    yield settings, theirs, mine
    file_guard.install(None)


def test_symlinked_files_into_the_artifact_store_are_refused(world) -> None:  # type: ignore[no-untyped-def]
    _, theirs, mine = world
    for name in ("config.json", "model.safetensors"):
        (mine / name).symlink_to(theirs / name)
    with pytest.raises(UnsafeFile, match="leads into the service's own storage"):
        load_model(ModelSource(hf_dir=str(mine)))
    with pytest.raises(UnsafeFile, match="model.safetensors leads into"):
        load_hf_state_dict(mine)  # each weight file is judged, not only the directory
    (mine / "model.gguf").symlink_to(theirs / "model.safetensors")
    with pytest.raises(UnsafeFile):
        load_model(ModelSource(gguf=str(mine / "model.gguf")))
    (mine / "rows.jsonl").symlink_to(theirs / "rows.jsonl")
    with pytest.raises(UnsafeFile, match="rows.jsonl leads into"):
        load_examples(DatasetSource(path=str(mine / "rows.jsonl"), prompt_column="question"))


def test_nested_symlinked_directory_is_refused(world) -> None:  # type: ignore[no-untyped-def]
    _, theirs, mine = world
    (mine / "config.json").write_text("{}")
    (mine / "sub" / "deeper").mkdir(parents=True)
    (mine / "sub" / "deeper" / "tok").symlink_to(theirs.parent)  # a directory link two levels down
    with pytest.raises(UnsafeFile, match="tok leads into"):
        load_model(ModelSource(hf_dir=str(mine)))
    with pytest.raises(UnsafeFile, match="tok leads into"):  # the drafter warm start walks its directory too
        build_drafter(OnlineDrafterConfig(warm_start_dir=str(mine)), target=None)  # type: ignore[arg-type]
    outside = mine.parents[2] / "elsewhere"  # not the store, but not a root either
    outside.mkdir()
    (mine / "sub" / "deeper" / "tok").unlink()
    (mine / "sub" / "deeper" / "tok").symlink_to(outside)
    with pytest.raises(UnsafeFile, match="outside the directories in TLT_SPEC_ROOTS"):
        load_model(ModelSource(hf_dir=str(mine)))


def test_hardlinked_file_is_refused(world) -> None:  # type: ignore[no-untyped-def]
    _, theirs, mine = world
    os.link(theirs / "model.safetensors", mine / "model.safetensors")
    (mine / "config.json").write_text("{}")
    with pytest.raises(UnsafeFile, match=r"hard-linked file \(2 links\)"):
        load_hf_state_dict(mine)
    os.link(theirs / "rows.jsonl", mine / "rows.jsonl")
    with pytest.raises(UnsafeFile, match="hard-linked"):
        load_examples(DatasetSource(path=str(mine / "rows.jsonl"), prompt_column="question"))


def test_own_files_and_links_inside_the_root_load(world) -> None:  # type: ignore[no-untyped-def]
    """What stays allowed: plain files in a root, and links that stay inside it (an HF cache snapshot's layout)."""
    _, _, mine = world
    blobs = mine.parent / "blobs"
    blobs.mkdir()
    save_file(WEIGHTS, str(blobs / "abc"))
    (mine / "model.safetensors").symlink_to(blobs / "abc")
    assert torch.equal(load_hf_state_dict(mine)["model.embed_tokens.weight"], WEIGHTS["model.embed_tokens.weight"])
    (mine / "rows.jsonl").write_text('{"question": "q", "answer": "1"}\n')
    rows = load_examples(DatasetSource(path=str(mine / "rows.jsonl"), prompt_column="question"))
    assert [r.prompt for r in rows] == ["q"]


def test_artifacts_named_by_id_stay_readable(world) -> None:  # type: ignore[no-untyped-def]
    """A runnable spec's id-resolved paths (one's own artifact, in the store) are trusted; the rest of the store is
    not, nor is the library guarded when it runs on its own."""
    settings, theirs, _ = world
    resolved = JobSpec.model_validate({"model": {"hf_dir": str(theirs)}, "dataset": {"builtin": "toy-count"}})
    guard = job_file_guard(resolved, settings)
    assert guard.tree(theirs) == theirs.resolve()
    assert guard.file(theirs / "model.safetensors") == (theirs / "model.safetensors").resolve()
    with pytest.raises(UnsafeFile):
        guard.file(settings.home / "tlt.db")
    file_guard.install(None)
    assert file_guard.current().tree(theirs) == theirs.resolve()  # the library alone: no service, no other users
    with pytest.raises(UnsafeFile, match="outside the directories"):
        FileGuard(roots=(), private=()).file("/etc/hostname")  # an enforcing guard with no roots allows nothing
