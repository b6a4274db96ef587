"""Two first runs of the default pair's preparation at once (issue 16, defect 8): the second waits
for the first and then reuses what it made, instead of training into the same cache folders."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

from tokenrouter.training import prepare as prep


def fake_prepare(settings, progress, log):
    """Stands in for the training: records overlapping runs, and makes the pair only once."""
    folder = prep.cache_dir()
    marker = folder / "running"
    if marker.exists():
        (folder / "overlap").write_text("two preparations ran at once")
    if (folder / "made").exists():
        (folder / "reused").touch()
        return "reused"
    marker.touch()
    time.sleep(1.5)
    (folder / "made").touch()
    marker.unlink()
    return "made"


def run(cache: str, out: str) -> None:
    import os

    os.environ["TOKENROUTER_CACHE"] = cache
    prep._prepare = fake_prepare  # the lock is what is under test, not the training
    Path(out).write_text(json.dumps(prep.prepare(threads=1, progress=False)))


def test_second_preparation_waits_then_reuses(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run, args=(str(tmp_path), str(tmp_path / f"out{i}"))) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    results = sorted(json.loads((tmp_path / f"out{i}").read_text()) for i in range(2))
    assert not (tmp_path / "overlap").exists()
    assert results == ["made", "reused"]
