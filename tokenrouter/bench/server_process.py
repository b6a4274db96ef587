"""Server subprocesses for tests, the soak and the benchmarks: `tokenrouter serve` (or any server
command) on a free loopback port, logging to a file, in its own session so that everything it starts
can be found and stopped: SIGTERM first, SIGKILL for whatever outlives the grace period."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> list[int]:
    """Direct child processes of pid (Linux /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out.extend(int(x) for x in (task / "children").read_text().split())
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = children(todo.pop())
        out.extend(kids)
        todo.extend(kids)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


class ManagedProcess:
    """A server subprocess in its own session (so its children can be found and killed), logging to a
    file, with a /health URL."""

    def __init__(self, name: str, cmd: list[str], port: int, log_dir: Path, cores: Sequence[int] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        if cores:
            cmd = ["taskset", "-c", ",".join(str(c) for c in cores), *cmd]
        self.cmd = cmd
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)
        self.pids: set[int] = {self.proc.pid}
        self._terminated = False

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not become healthy in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)
        self.pids.update(descendants(self.proc.pid))

    def terminate(self) -> None:
        """Send SIGTERM once (a second one would cut uvicorn's graceful shutdown short)."""
        if self.proc.poll() is None:
            self.pids.update(descendants(self.proc.pid))
            if not self._terminated:
                self._terminated = True
                self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait, then SIGKILL the process and everything it started; its exit code."""
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        # Children that outlived their parent (they share its session and process group).
        deadline = time.monotonic() + 5.0
        while any(alive(p) for p in self.pids - {self.proc.pid}) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.pids - {self.proc.pid}:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if not self._log.closed:
            self._log.close()
        return int(self.proc.returncode)

    def alive_pids(self) -> list[int]:
        return [p for p in self.pids if alive(p)]


class ServerProcess(ManagedProcess):
    """`tokenrouter serve ARGS` on a free loopback port, healthy when the constructor returns.
    `subservers` are its direct children (the model processes)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, startup_timeout: float = 120.0,
                 log_dir: str | Path | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="tokenrouter-serve-") if log_dir is None else None
        port = free_port()
        cmd = [sys.executable, "-m", "tokenrouter.cli", "serve", "--port", str(port), "--log-level", "warning",
               *args]
        super().__init__("serve", cmd, port, Path(self._tmp.name if self._tmp else log_dir), env=env)
        self.wait_healthy(startup_timeout)
        self.subservers = children(self.proc.pid)

    def stop(self, timeout: float = 30.0) -> int:
        rc = super().stop(timeout)
        if self._tmp is not None:
            self._tmp.cleanup()
        return rc
