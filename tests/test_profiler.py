"""`tokenrouter profile` measures a model's step latency into a profile the executor can load."""

from __future__ import annotations

import json

from tokenrouter import cli
from tokenrouter.engine.latency_model import LatencyProfile


def test_profile_writes_and_merges(tmp_path, pair_paths, capsys):
    out = tmp_path / "profile.json"
    for name in ("small", "large"):
        rc = cli.main(["profile", "--model-path", str(pair_paths[name]), "--name", name, "--out", str(out),
                       "--batch-sizes", "1", "4", "--steps", "3", "--kv-cache-tokens", "4096"])
        assert rc == 0
    prof = LatencyProfile.load(out)
    assert set(prof.models) == {"small", "large"}
    for lat in prof.models.values():
        assert [b for b, _ in lat.table] == [1, 4]
        assert all(sec > 0 for _, sec in lat.table)
        assert lat.per_token >= 0
        assert lat(2, 2) > 0
    assert "ms per decode step" in capsys.readouterr().out
    json.loads(out.read_text())  # plain JSON, editable by hand
