"""`pip install .` from a clean copy gives a working `tokenrouter serve`: the wheel holds every file the
package reads beside its modules at run time (the routing page's files, the C sources it compiles:
whatever a module names with Path(__file__).with_name), and, installed by pip into a folder of its own,
the package finds them there and serves its page and a completion."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx

from tokenrouter.bench.server_process import ManagedProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tokenrouter"
# A module's own data file or folder: SOURCE = Path(__file__).with_name("fused_ops.c"), UI_DIR = ...("ui").
DATA_REF = re.compile(r"""Path\(__file__\)\.with_name\(["']([^"']+)["']\)""")


def runtime_files() -> set[str]:
    """Every non-Python file a module of the package reads beside itself, relative to the repository."""
    found: set[str] = set()
    for module in PACKAGE.rglob("*.py"):
        for name in DATA_REF.findall(module.read_text()):
            target = module.with_name(name)
            files = [p for p in target.rglob("*") if p.is_file()] if target.is_dir() else [target]
            found.update(str(p.relative_to(ROOT)) for p in files if "__pycache__" not in p.parts)
    return found


def pip(*args: str, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-index", "-q"], cwd=cwd,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_wheel_ships_what_serve_reads(tmp_path, pair_paths):
    expected = runtime_files()
    assert {"tokenrouter/server/ui/index.html", "tokenrouter/server/ui/app.js", "tokenrouter/models/fused_ops.c",
            "tokenrouter/models/skinny_gemm.c", "tokenrouter/models/attention/paged_decode.c"} <= expected
    assert all((ROOT / f).is_file() for f in expected)

    # A clean checkout: the package's sources and the files pyproject.toml names, nothing built.
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "tokenrouter", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    pip("wheel", str(src), "--no-build-isolation", "-w", str(tmp_path / "dist"), cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("tokenrouter-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert sorted(expected - names) == []
    assert "tokenrouter = tokenrouter.cli:main" in entry_points

    # Installed as pip installs it, into a folder searched before the checkout's editable install.
    site = tmp_path / "site"
    pip("install", "--target", str(site), str(wheel), cwd=tmp_path)
    env = {"PYTHONPATH": str(site)}
    probe = ("import tokenrouter.server.page as p, tokenrouter.models.fused_ops as f, "
             "tokenrouter.models.skinny_gemm as s, tokenrouter.models.attention.paged_decode_kernel as k; "
             "print(p.UI_DIR, f.SOURCE, s.SOURCE, k.SOURCE)")
    done = subprocess.run([sys.executable, "-P", "-c", probe], cwd=tmp_path, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    paths = [Path(p) for p in done.stdout.split()]
    assert len(paths) == 4 and all(p.is_relative_to(site) and p.exists() for p in paths), paths

    port = free_port()
    server = ManagedProcess("serve", [str(site / "bin" / "tokenrouter"), "serve", "--port", str(port), "--model-path",
                                      str(pair_paths["small"]), "--kv-cache-tokens", "2048", "--served-model-name",
                                      "tiny", "--log-level", "warning"], port, tmp_path, env=env)
    try:
        server.wait_healthy(120)
        page = httpx.get(f"{server.url}/", timeout=10)
        assert page.status_code == 200 and page.text == (site / "tokenrouter/server/ui/index.html").read_text()
        assert httpx.get(f"{server.url}/ui/app.js", timeout=10).status_code == 200
        answer = httpx.post(f"{server.url}/v1/completions", timeout=60,
                            json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()
