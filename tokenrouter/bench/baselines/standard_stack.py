"""The whole standard-serving baseline as processes, for benchmarks and tests: the small and the large
model each in a plain `tokenrouter serve`, plus the coordinator (standard.py) over them."""

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tokenrouter.bench.server_process import ManagedProcess, free_port


def start_plain_server(name: str, model_path: str | Path, log_dir: Path, cores: Sequence[int] | None = None,
                       server_args: Sequence[str] = (), source: Sequence[str] | None = None) -> ManagedProcess:
    """`tokenrouter serve --model-path PATH` on a free port (not yet waited for). `source` replaces
    `--model-path PATH` (e.g. `--config ONE_MODEL.yaml` for a model on the latency-model executor)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenrouter.cli", "serve", *(source or ["--model-path", str(model_path)]),
           "--port", str(port), "--log-level", "warning", "--grace-period", "5", *server_args]
    return ManagedProcess(name, cmd, port, log_dir, cores)


def start_coordinator(small_url: str, large_url: str, small_tokenizer: str | Path, p: float, log_dir: Path,
                      model_name: str = "standard", cores: Sequence[int] | None = None,
                      name: str = "coordinator", extra_args: Sequence[str] = ()) -> ManagedProcess:
    """The coordinator (`python -m tokenrouter.bench.baselines.standard`) on a free port (not yet waited for)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenrouter.bench.baselines.standard", "--small-url", small_url,
           "--large-url", large_url, "--small-tokenizer", str(small_tokenizer), "--p", repr(float(p)),
           "--port", str(port), "--model-name", model_name, "--log-level", "warning", *extra_args]
    return ManagedProcess(name, cmd, port, log_dir, cores)


class StandardStack:
    """The whole standard-serving baseline: small and large plain servers plus the coordinator.

        with StandardStack(small_path, large_path, p=0.1, small_cores=[0], large_cores=[1]) as stack:
            ... POST f"{stack.url}/v1/completions" with model=stack.model_name ...

    Every process runs with OMP_NUM_THREADS=1 (plus `taskset -c` when cores are given); stop() (or
    leaving the `with`) sends SIGTERM, then SIGKILL, and leaves no process behind.
    """

    def __init__(self, small_path: str | Path, large_path: str | Path, p: float, *,
                 small_cores: Sequence[int] | None = None, large_cores: Sequence[int] | None = None,
                 coordinator_cores: Sequence[int] | None = None, server_args: Sequence[str] = (),
                 small_source: Sequence[str] | None = None, large_source: Sequence[str] | None = None,
                 model_name: str = "standard", log_dir: str | Path | None = None,
                 startup_timeout: float = 180.0) -> None:
        """`small_source` / `large_source`: serve arguments naming each model instead of `--model-path`
        (see start_plain_server); the small folder's tokenizer still serves the coordinator."""
        self.small_path, self.large_path, self.p = Path(small_path), Path(large_path), float(p)
        self.sources = {"small": small_source, "large": large_source}
        self.small_cores, self.large_cores, self.coordinator_cores = small_cores, large_cores, coordinator_cores
        self.server_args = list(server_args)
        self.model_name = model_name
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="standard-stack-")
            log_dir = self._tmp.name
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout = startup_timeout
        self.procs: list[ManagedProcess] = []
        self.small: ManagedProcess | None = None
        self.large: ManagedProcess | None = None
        self.coordinator: ManagedProcess | None = None

    @property
    def url(self) -> str:
        assert self.coordinator is not None, "start() first"
        return self.coordinator.url

    def start(self) -> "StandardStack":
        try:
            self.small = start_plain_server("small", self.small_path, self.log_dir, self.small_cores, self.server_args,
                                            self.sources["small"])
            self.procs.append(self.small)
            self.large = start_plain_server("large", self.large_path, self.log_dir, self.large_cores, self.server_args,
                                            self.sources["large"])
            self.procs.append(self.large)
            self.small.wait_healthy(self.startup_timeout)
            self.large.wait_healthy(self.startup_timeout)
            self.coordinator = self.add_coordinator(self.p, self.model_name, name="coordinator",
                                                    cores=self.coordinator_cores)
        except BaseException:
            self.stop()
            raise
        return self

    def add_coordinator(self, p: float, model_name: str, name: str | None = None,
                        cores: Sequence[int] | None = None, wait: bool = True) -> ManagedProcess:
        """Another coordinator over the same two servers (e.g. a different p); stopped with the stack."""
        assert self.small is not None and self.large is not None, "start() first"
        proc = start_coordinator(self.small.url, self.large.url, self.small_path, p, self.log_dir, model_name,
                                 cores, name or f"coordinator-{len(self.procs)}")
        self.procs.append(proc)
        if wait:
            proc.wait_healthy(self.startup_timeout)
        return proc

    def stop(self) -> None:
        # Coordinators first (they hold connections to the servers), then the servers in parallel.
        for proc in reversed(self.procs):
            if proc.name.startswith("coordinator"):
                proc.stop()
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.stop()

    def alive_pids(self) -> list[int]:
        return [pid for proc in self.procs for pid in proc.alive_pids()]

    def cleanup_logs(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "StandardStack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.cleanup_logs()
