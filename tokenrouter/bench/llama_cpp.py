"""llama.cpp's `llama-server`, the CPU peer a user would pick instead of us, built once from the
llama.cpp sources that the package registry's `llama-cpp-python` sdist carries (its tarball vendors
llama.cpp with tools/server; the registry serves no binary of it).

    from tokenrouter.bench.llama_cpp import llama_server
    binary = llama_server()          # builds on first use (cmake, CPU backend, native flags)

The build lives in the project's cache folder (cache_dir()/llama.cpp/<version>), outside the
repository; a finished build is marked by a stamp file, so an interrupted one is redone.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tokenrouter.cache_dir import cache_dir

logger = logging.getLogger(__name__)

SDIST = "llama-cpp-python"
VERSION = "0.3.36"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF")
TARGETS = ("llama-server",)
# ggml's AMX matrix path (compiled in where -march=native offers AMX) crashed llama-server here at its
# first product (SIGSEGV in ggml_backend_amx_mul_mat, 2026-12-05, on a 2-core AMD EPYC with AMX): on
# x86 the build keeps every other native instruction set and leaves AMX out.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILD_TAG = "no-amx"  # part of the build folder's name: a build made otherwise is not reused


class LlamaCppBuildError(RuntimeError):
    """A step of the build failed; the message names it and where its log is."""


def build_dir(version: str = VERSION) -> Path:
    return cache_dir() / "llama.cpp" / f"{version}-{BUILD_TAG}"


def cmake_flags() -> list[str]:
    flags = list(CMAKE_FLAGS)
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return flags


def _run(cmd: list[str], log: Path, what: str, cwd: Path | None = None) -> None:
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        rc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise LlamaCppBuildError(f"{what} failed (exit {rc}); see {log}")


def _sources(root: Path, version: str, log: Path) -> Path:
    """The vendored llama.cpp folder of the sdist, downloaded and unpacked under root."""
    src = root / "src"
    found = list(src.glob("*/vendor/llama.cpp"))
    if found:
        return found[0]
    dl = root / "download"
    dl.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dl),
          f"{SDIST}=={version}"], log, f"downloading the {SDIST} {version} sdist")
    tarballs = sorted(dl.glob("*.tar.gz"))
    if not tarballs:
        raise LlamaCppBuildError(f"pip downloaded no sdist of {SDIST} {version} into {dl}")
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".src-"))
    with tarfile.open(tarballs[0]) as tar:
        tar.extractall(tmp, filter="data")
    os.replace(tmp, src)
    found = list(src.glob("*/vendor/llama.cpp"))
    if not found:
        raise LlamaCppBuildError(f"the {SDIST} sdist has no vendor/llama.cpp folder")
    return found[0]


def llama_server(version: str = VERSION, jobs: int | None = None) -> Path:
    """The path of a built `llama-server` (building it first when needed: about 10-20 minutes on 2
    cores). `jobs`: parallel compile jobs (default: the cores this process may use)."""
    root = build_dir(version)
    binary = root / "build" / "bin" / "llama-server"
    stamp = root / "built"
    if stamp.is_file() and binary.is_file():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise LlamaCppBuildError(f"building llama.cpp needs {tool}, which is not on PATH")
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    src = _sources(root, version, log)
    logger.info("building llama.cpp's llama-server from %s (log: %s)", src, log)
    build = root / "build"
    _run(["cmake", "-S", str(src), "-B", str(build), *cmake_flags()], log, "cmake configure")
    jobs = jobs or len(os.sched_getaffinity(0))
    _run(["cmake", "--build", str(build), "-j", str(jobs), "--target", *TARGETS], log, "cmake build")
    if not binary.is_file():
        raise LlamaCppBuildError(f"the build finished without {binary}; see {log}")
    stamp.write_text(f"{SDIST} {version}\n")
    return binary


def server_env(binary: Path) -> dict[str, str]:
    """The environment llama-server runs in (its shared libraries beside it, if the build made any)."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(binary.parent), env.get("LD_LIBRARY_PATH")]))
    return env


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(llama_server())
