"""What tests/isolation/test_two_suites.py runs as two pytest sessions at once (not collected by the suite itself:
the file name does not start with test_). Each session meets its sibling at a file barrier, then uses its Redis
database and builds a torch C++ extension while the other does the same."""

from __future__ import annotations

import os
import time
from pathlib import Path

import redis

BARRIER = Path(os.environ["TLT_PROBE_BARRIER"])
ME = os.environ["TLT_PROBE_NAME"]


def _meet(stage: str, timeout_s: float = 120) -> None:
    """Wait until both sessions reached `stage`, so what follows overlaps in time."""
    (BARRIER / f"{stage}.{ME}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(BARRIER.glob(f"{stage}.*"))) < 2:
        assert time.monotonic() < deadline, f"the sibling session never reached {stage!r}"
        time.sleep(0.1)


def test_redis_database_is_this_runs_alone(redis_url: str) -> None:
    _meet("claimed")
    db = redis.Redis.from_url(redis_url)
    db.set(f"probe:{ME}", ME)
    _meet("written")  # a sibling on the same database would have flushed or added keys by now
    assert db.keys("*") == [f"probe:{ME}".encode()]
    _meet("checked")


def test_extensions_build_in_a_private_directory() -> None:
    from torch.utils.cpp_extension import load_inline

    # With the user-wide cache this waits forever on the planted lock (the per-test timeout then fails it).
    module = load_inline("tlt_probe", cpp_sources="int answer() { return 42; }", functions=["answer"])
    assert module.answer() == 42
    built_in = Path(module.__file__).parent.parent
    assert built_in == Path(os.environ["TORCH_EXTENSIONS_DIR"]), built_in
    assert not built_in.is_relative_to(Path(os.environ["XDG_CACHE_HOME"])), built_in
