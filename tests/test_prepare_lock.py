"""Two first runs of the default pair's preparation at once: while one prepares, the cache folder's
lock is observed held from another process, and a second preparation waits until the first is done,
then reuses what it made instead of training into the same cache folders."""

from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest

from tokenrouter.training import prepare as prep


def fake_prepare(settings, progress, log, on_stage):
    """Stands in for the training: says it is running, and holds on until the test lets it go."""
    folder = prep.cache_dir()
    if (folder / "made").exists():
        (folder / "reused").touch()
        return "reused"
    (folder / "running").touch()
    deadline = time.monotonic() + 60
    while not (folder / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (folder / "made").touch()
    return "made"


def run(cache: str, out: str) -> None:
    import os

    os.environ["TOKENROUTER_CACHE"] = cache
    prep._prepare = fake_prepare  # the lock is what is under test, not the training
    Path(out).write_text(json.dumps(prep.prepare(threads=1, progress=False)))


def wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def test_the_lock_is_held_while_preparing_and_a_second_run_waits(tmp_path):
    ctx = mp.get_context("spawn")
    first = ctx.Process(target=run, args=(str(tmp_path), str(tmp_path / "out0")))
    second = ctx.Process(target=run, args=(str(tmp_path), str(tmp_path / "out1")))
    first.start()
    try:
        wait_for(tmp_path / "running")
        with open(tmp_path / "prepare.lock", "a") as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # this process sees the first one's lock
        second.start()
        time.sleep(3.0)  # long enough for the second to start and reach the lock (a liveness window)
        assert second.is_alive() and not (tmp_path / "out1").exists(), "the second ran during the first"
        assert not (tmp_path / "reused").exists()
        (tmp_path / "release").touch()
        for p in (first, second):
            p.join(60)
            assert p.exitcode == 0
    finally:
        for p in (first, second):
            if p.is_alive():
                p.kill()
    assert [json.loads((tmp_path / f"out{i}").read_text()) for i in range(2)] == ["made", "reused"]
    with open(tmp_path / "prepare.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released once both are done
