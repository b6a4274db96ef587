"""`tokenrouter bench compare`: systems side by side, one after the other in one run, on the same
workload, prompts and seeds, with the ratios printed.

Systems: `tokenrouter` (the routed group of --config), `large` and `small` (each model alone in our
server), `standard` (plain single-model servers and an outside one-token-at-a-time coordinator;
bernoulli routing, at tokenrouter's measured large-model share for router algorithms), and
`step-sync` (the research codes' execution: static batches, a global barrier; run in-process on our
engines, so it pays no HTTP cost, which favours it), and `vllm` (vLLM's OpenAI server serving the
large model, from the virtualenv of --vllm-venv: vLLM is never a project dependency; one thread,
float32, its default compiled model; the same client, prompts and caps), and `llama.cpp` (llama.cpp's
`llama-server` serving the large model folder's GGUF file, model.gguf, as it stores it, with
LLAMA_CPP_THREADS threads and a slot per concurrent request; built once from the registry's
llama-cpp-python sdist into the cache: bench/llama_cpp.py).

A group on the latency-model executor (`executor: {mode: latency, profile: ...}`) puts every system on
it: each model alone, the standard stack's plain servers and step-sync's engines wait the profile's
step latencies too, so the comparison is at the profile's (paper) scale while HTTP, tokenising,
scheduling and transport stay real. `--range-ratio` gives requests output caps drawn between
ratio x cap and cap (the same for every system), as answers that end at EOS have.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import psutil
import yaml

from tokenrouter.bench.loadgen import BenchConfig, run_bench, write_jsonl
from tokenrouter.bench.server_process import ManagedProcess, ServerProcess, free_port
from tokenrouter.bench.workloads import WORKLOADS, build_prompts, output_lengths
from tokenrouter.routing import make_algorithm
from tokenrouter.runtime.group_config import GroupConfig

SYSTEMS = ("tokenrouter", "large", "small", "standard", "step-sync", "vllm", "llama.cpp")
# llama.cpp's server on the CPU's cores (its own thread pool), one slot per concurrent request.
LLAMA_CPP_THREADS = 2
# vLLM's CPU build on one core (one OpenMP thread) with 2 GiB of KV, as benchmarks/bench_vllm.py runs it.
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"}


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each named process (0 for one that is gone)."""
    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            out[name] = 0.0
    return out


def _model_processes(srv: ServerProcess) -> list[int]:
    """The server's subservers (its children other than multiprocessing's resource tracker)."""
    pids = []
    for pid in srv.subservers:
        with contextlib.suppress(psutil.Error):
            if "resource_tracker" not in " ".join(psutil.Process(pid).cmdline()):
                pids.append(pid)
    return pids


def _http_run(url: str, model: str, prompts: list[str], caps: list[int], c: int, n: int,
              seed: int, processes: dict[str, int] | None = None) -> dict[str, Any]:
    """One closed-loop run. With `processes` (name -> pid of the system's processes), the summary's
    `cpu_share` gives each one's CPU seconds over the run's wall time, and the load generator's (this
    process): where the cores went, which on a small machine bounds what a system can show."""
    cfg = BenchConfig(base_url=url, model=model, prompts=prompts, max_tokens=max(caps), num_requests=n,
                      concurrency=c, warmup=min(2, n), seed=seed, output_lens=caps)
    pids = {**(processes or {}), "load generator": os.getpid()}
    before, wall = _cpu_seconds(pids), time.perf_counter()
    summary, results = asyncio.run(run_bench(cfg, progress=False))
    wall, after = time.perf_counter() - wall, _cpu_seconds(pids)
    cpu = {name: round((after[name] - before[name]) / wall, 3) for name in pids}
    return {**summary, "cpu_share": cpu,
            "requests": [asdict(r) for r in results]}  # `bench plot` draws latency CDFs from these


def _on_latency_executor(group: GroupConfig) -> bool:
    return group.executor.latency


def _alone_config(group: GroupConfig, name: str, folder: str, page_size: int | None = None) -> str:
    """A YAML serving model `name` of the group alone, on the group's executor (so on the latency
    executor a model alone waits the same step latencies as in the group)."""
    d = group.to_dict()
    d["models"] = [{**m, "page_size": page_size or m["page_size"]} for m in d["models"] if m["name"] == name]
    d.update(algorithm="single", algorithm_params={}, name=name, launch={"policy": "eager"}, routers={})
    path = Path(folder) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return str(path)


def _step_sync(group: GroupConfig, prompts: list[str], caps: list[int], c: int, seed: int) -> dict[str, Any]:
    from tokenrouter.bench.baselines.step_sync import run_step_sync
    from tokenrouter.engine.engine import Engine
    from tokenrouter.engine.latency_model import LatencyModelRunner
    from tokenrouter.routing.deferral import DeferToLarge
    from tokenrouter.sampling_params import SamplingParams

    router = make_algorithm(group.algorithm, group.names, group.algorithm_params)
    if not isinstance(router, DeferToLarge):
        raise ValueError(f"step-sync runs one-token deferral algorithms, not {group.algorithm!r}")
    profile = group.executor.profile if _on_latency_executor(group) else None
    engines = []
    for name in group.names:
        spec = group.spec(name)
        if profile is not None:  # the models never step at once here, so interference does not arise
            runner = LatencyModelRunner.for_model(profile, name, spec.engine.model_path)
            engines.append(Engine(replace(spec.engine, seed=group.seed), latency_runner=runner))
        else:
            engines.append(Engine(replace(spec.engine, seed=group.seed), outputs=router.outputs(name)))
    for name, eng in zip(group.names, engines):
        router.bind(name, eng)
    ids = [p if isinstance(p, list) else engines[0].tokenize(p) for p in prompts]
    params = [SamplingParams(max_tokens=cap, temperature=0.0, ignore_eos=True) for cap in caps]
    res = run_step_sync(engines[0], engines[1], router, ids, params, c, seed=seed)
    return {"concurrency": c, "completed": len(ids), "failed": 0, "output_tokens": res.output_tokens,
            "duration_s": res.wall_seconds, "output_throughput": res.throughput,
            "per_user_tok_s": {"mean": sum(res.per_user) / len(res.per_user)},
            "tokens_per_model": res.tokens_per_model,
            "requests": [{"e2e": lat} for lat in res.latencies]}  # from its batch's start; no streaming, no TTFT


def compare(config: str, systems: list[str], workload: str, scale: str, concurrencies: list[int], num_requests: int,
            max_tokens: int | None, seed: int, out: str | None, range_ratio: float = 1.0,
            vllm_venv: str | None = None) -> list[dict[str, Any]]:
    group = GroupConfig.from_yaml(config)
    if len(group.models) != 2:
        raise ValueError("compare needs a group of two models (small first, large second)")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system {unknown[0]!r}; available: {', '.join(SYSTEMS)}")
    if "vllm" in systems and (vllm_venv is None or not (Path(vllm_venv) / "bin" / "python").is_file()):
        raise ValueError(f"system 'vllm' needs --vllm-venv, a virtualenv with vllm-cpu installed (got {vllm_venv!r}; "
                         "see benchmarks/bench_vllm.py for the recipe)")
    tokenizer = None
    if workload in WORKLOADS and WORKLOADS[workload].chat:
        from tokenrouter.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(group.models[1].engine.model_path)
    prompts, cap = build_prompts(workload, scale, num_requests, seed, tokenizer)
    caps = output_lengths(max_tokens or cap, len(prompts), range_ratio, seed)
    if _on_latency_executor(group) and any(group.executor.profile.interference.get(m, {}) for m in group.names):
        print("  note: the profile's interference slows only the routed group's co-located subservers; the "
              "baselines' separate servers run without it, which favours them", flush=True)
    rows: list[dict[str, Any]] = []

    def record(system: str, summary: dict[str, Any]) -> None:
        row = {"label": system, "workload": workload, "scale": scale, **summary}
        rows.append(row)
        if out:
            write_jsonl(out, row)
        print(f"  {system:12s} concurrency {summary['concurrency']:3d}: {summary['output_throughput']:9.1f} tok/s  "
              f"per-user {summary['per_user_tok_s']['mean'] or 0:7.1f} tok/s  {summary.get('tokens_per_model', {})}",
              flush=True)
        if summary.get("cpu_share"):
            print("    CPU share (CPU seconds / wall seconds): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in summary["cpu_share"].items()), flush=True)

    with tempfile.TemporaryDirectory(prefix="tokenrouter-compare-") as tmp:
        for system in systems:
            print(f"{system}:", flush=True)
            if system == "step-sync":
                for c in concurrencies:
                    record(system, _step_sync(group, prompts, caps, c, seed))
            elif system == "vllm":
                for summary in _vllm(group, vllm_venv or "", tmp, prompts, caps, concurrencies, num_requests, seed):
                    record(system, summary)
            elif system == "llama.cpp":
                for summary in _llama_cpp(group, tmp, prompts, caps, concurrencies, num_requests, seed):
                    record(system, summary)
            elif system == "standard":
                for summary in _standard(group, rows, tmp, prompts, caps, concurrencies, num_requests, seed):
                    record(system, summary)
            else:
                for summary in _alone_or_routed(group, config, system, tmp, prompts, caps, concurrencies,
                                                num_requests, seed):
                    record(system, summary)
    _print_ratios(rows, concurrencies)
    return rows


def _standard(group: GroupConfig, rows: list[dict[str, Any]], tmp: str, prompts: list[str], caps: list[int],
              concurrencies: list[int], num_requests: int, seed: int) -> list[dict[str, Any]]:
    from tokenrouter.bench.baselines.standard_stack import StandardStack

    small, large = group.models
    # Page size 1: a one-token request then recomputes nothing its prefix cache holds (see standard.py).
    sources = {m.name: ["--config", _alone_config(group, m.name, tmp, page_size=1)] for m in group.models} \
        if _on_latency_executor(group) else {}
    with StandardStack(small.engine.model_path, large.engine.model_path, _standard_p(group, rows),
                       small_cores=small.cores, large_cores=large.cores, small_source=sources.get(small.name),
                       large_source=sources.get(large.name), server_args=[] if sources else ["--page-size", "1"]) \
            as stack:
        return [_http_run(stack.url, stack.model_name, prompts, caps, c, num_requests, seed) for c in concurrencies]


def _alone_or_routed(group: GroupConfig, config: str, system: str, tmp: str, prompts: list[str], caps: list[int],
                     concurrencies: list[int], num_requests: int, seed: int) -> list[dict[str, Any]]:
    """`tokenrouter` (the group of `config`) or `small` / `large` (that model alone), in our server."""
    if system == "tokenrouter":
        args, model = ["--config", config], group.name
    else:
        spec = group.models[0] if system == "small" else group.models[1]
        model = system
        if _on_latency_executor(group):
            args = ["--config", _alone_config(group, spec.name, tmp), "--served-model-name", system]
        else:
            eng = spec.engine
            args = ["--model-path", eng.model_path, "--served-model-name", system, "--page-size", str(eng.page_size)]
            if eng.kv_cache_tokens:
                args += ["--kv-cache-tokens", str(eng.kv_cache_tokens)]
    srv = ServerProcess(args + ["--log-level", "warning"], startup_timeout=600)
    processes = {"server": srv.proc.pid, **{f"subserver {i}": pid for i, pid in enumerate(_model_processes(srv))}}
    try:
        return [_http_run(srv.url, model, prompts, caps, c, num_requests, seed, processes) for c in concurrencies]
    finally:
        srv.stop()


def _vllm(group: GroupConfig, venv: str, tmp: str, prompts: list[Any], caps: list[int], concurrencies: list[int],
          num_requests: int, seed: int) -> list[dict[str, Any]]:
    """vLLM's OpenAI server on the large model's folder, through the same client as the others."""
    if _on_latency_executor(group):
        raise ValueError("system 'vllm' runs the real large model; the group is on the latency-model executor")
    port = free_port()
    # The module, not the `vllm` script: the CPU build's distribution is named vllm-cpu, which the
    # script's version lookup does not find.
    cmd = [str(Path(venv) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
           group.models[1].engine.model_path, "--served-model-name", "vllm",
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--seed", str(seed),
           "--max-num-seqs", str(max(concurrencies))]
    srv = ManagedProcess("vllm", cmd, port, Path(tmp), env=VLLM_ENV)
    try:
        srv.wait_healthy(900)  # the first start compiles the model (minutes; cached afterwards)
        # vLLM's engine core is a process of its own under the API server
        processes = {"vllm": srv.proc.pid, **{f"vllm process {i}": pid
                                              for i, pid in enumerate(sorted(srv.pids - {srv.proc.pid}))}}
        return [_http_run(srv.url, "vllm", prompts, caps, c, num_requests, seed, processes) for c in concurrencies]
    finally:
        srv.stop()


def _llama_cpp(group: GroupConfig, tmp: str, prompts: list[Any], caps: list[int], concurrencies: list[int],
               num_requests: int, seed: int) -> list[dict[str, Any]]:
    """llama.cpp's server on the large model's GGUF file, through the same client as the others."""
    from tokenrouter.bench.llama_cpp import llama_server, server_env
    from tokenrouter.models.gguf_weights import GGUF_FILE

    if _on_latency_executor(group):
        raise ValueError("system 'llama.cpp' runs the real large model; the group is on the latency-model executor")
    gguf = Path(group.models[1].engine.model_path) / GGUF_FILE
    if not gguf.is_file():
        raise ValueError(f"system 'llama.cpp' serves the large model's GGUF file, and {gguf} is missing")
    binary = llama_server()
    port = free_port()
    slots = max(concurrencies)
    # Context per slot: the prompts plus the longest answer, with room (llama-server splits -c over slots).
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(LLAMA_CPP_THREADS),
           "-np", str(slots), "-c", str(slots * 1024), "--seed", str(seed), "--alias", "llama.cpp", "--no-webui"]
    srv = ManagedProcess("llama.cpp", cmd, port, Path(tmp), env=server_env(binary))
    try:
        srv.wait_healthy(300)
        return [_http_run(srv.url, "llama.cpp", prompts, caps, c, num_requests, seed, {"llama.cpp": srv.proc.pid})
                for c in concurrencies]
    finally:
        srv.stop()


def _standard_p(group: GroupConfig, rows: list[dict[str, Any]]) -> float:
    """The hand-off probability the standard coordinator draws with. Its plain servers answer through
    the OpenAI API, which carries no hidden states, so a router head cannot run there: for a router
    algorithm the coordinator sends positions to the large model with bernoulli draws at the share of
    tokens the large model wrote in this run's tokenrouter rows (the same load, not the same positions)."""
    if group.algorithm == "bernoulli":  # its p, the group's or the class's default
        return float(make_algorithm(group.algorithm, group.names, group.algorithm_params).p)  # type: ignore[attr-defined]
    written = [r.get("tokens_per_model", {}) for r in rows if r["label"] == "tokenrouter"]
    total = sum(sum(w.values()) for w in written)
    if not total:
        raise ValueError(f"standard serving with {group.algorithm!r} draws at tokenrouter's measured large-model "
                         "share: list tokenrouter before standard in --systems")
    p = sum(w.get(group.names[1], 0) for w in written) / total
    print(f"  (standard: bernoulli at p = {p:.3f}, the large model's share of tokens in the tokenrouter rows)")
    return p


def _print_ratios(rows: list[dict[str, Any]], concurrencies: list[int]) -> None:
    by = {(r["label"], r["concurrency"]): r["output_throughput"] for r in rows}
    print("\nratios (tokenrouter / system, output throughput):")
    for c in concurrencies:
        ours = by.get(("tokenrouter", c))
        if ours is None:
            continue
        cells = [f"{s} {ours / by[(s, c)]:.2f}x" for s in SYSTEMS[1:] if by.get((s, c))]
        base = [by[(s, c)] for s in ("standard", "step-sync") if by.get((s, c))]
        strongest = f"; against the stronger baseline {ours / max(base):.2f}x" if base else ""
        print(f"  concurrency {c}: " + ", ".join(cells) + strongest)


def add_compare_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    c = bsub.add_parser("compare", help="run systems side by side on one workload and print the ratios")
    c.add_argument("--config", required=True, help="the routed group (two models, small first)")
    c.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    c.add_argument("--workload", default="reasoning-low", choices=sorted(WORKLOADS))
    c.add_argument("--scale", default="cpu", choices=["cpu", "paper"])
    c.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    c.add_argument("--num-requests", type=int, default=16)
    c.add_argument("--max-tokens", type=int, default=None, help="override the workload's output cap")
    c.add_argument("--range-ratio", type=float, default=1.0,
                   help="output caps uniform in [ratio x cap, cap] per request, the same for every system")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", default=None, help="append the rows (JSONL) here")
    c.add_argument("--vllm-venv", default=None, help="virtualenv with vllm-cpu, for the system 'vllm'")
    c.set_defaults(func=lambda a: _cmd(a))


def _cmd(args: argparse.Namespace) -> int:
    rows = compare(args.config, [s.strip() for s in args.systems.split(",") if s.strip()], args.workload, args.scale,
                   args.concurrency, args.num_requests, args.max_tokens, args.seed, args.out, args.range_ratio,
                   args.vllm_venv)
    print(json.dumps({"rows": len(rows)}))
    return 0
