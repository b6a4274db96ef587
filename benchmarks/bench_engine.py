"""Offline throughput: our engine vs Hugging Face transformers on the same random-weight model.

Workload: N requests of P random prompt tokens each, every request generating exactly O tokens
(greedy, EOS ignored). The metric is output tokens per second: total output tokens divided by the wall
time of one `generate` call, prefill included. Each system first runs a short warm-up that is not
counted, and each system runs in its own subprocess, one after another, with one torch thread.

Systems:
  ours               tokenrouter's `LLM.generate` (paged KV, continuous batching, chunked prefill)
  hf-generate        transformers `model.generate` on the whole batch at once (left padding, SDPA)
  hf-generate-batch  transformers continuous batching, `model.generate_batch` (paged cache)

Greedy outputs of every system are compared token for token with the first system's.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_engine.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_engine.py --systems ours --num-requests 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SYSTEMS = ("ours", "hf-generate", "hf-generate-batch")
WARMUP_REQUESTS = 4
WARMUP_PROMPT_LEN = 32
WARMUP_OUTPUT_LEN = 8


def make_prompts(n: int, length: int, seed: int, low: int = 3, high: int = 259) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n, length), generator=g).tolist()


def model_folder(preset: str, seed: int, cache_dir: Path) -> Path:
    folder = cache_dir / f"llama-{preset}-seed{seed}"
    if not (folder / "model.safetensors").exists():
        from tokenrouter.models.random_model import build_random_model

        tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".build-"))
        build_random_model(tmp, arch="llama", preset=preset, seed=seed)
        tmp.rename(folder)
    return folder


# ---- the systems (each runs in its own process) -------------------------------------------------

def run_ours(folder: Path, prompts: list[list[int]], warm: list[list[int]], output_len: int,
             args: argparse.Namespace) -> dict:
    from tokenrouter import LLM, SamplingParams

    kv_tokens = len(prompts) * (len(prompts[0]) + output_len + args.page_size)
    llm = LLM(str(folder), max_running_requests=len(prompts), chunked_prefill_size=args.chunked_prefill_size,
              kv_cache_tokens=kv_tokens, page_size=args.page_size, num_threads=1)

    def gen(ps: list[list[int]], n: int):
        return llm.generate(prompt_token_ids=ps, use_tqdm=False,
                            sampling_params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))

    gen(warm, WARMUP_OUTPUT_LEN)
    # Warm-up prompts are other random ids: no 16-token page of them matches a timed prompt, so the
    # prefix cache gives the timed run nothing (cached_prompt_tokens below shows it).
    steps0, ext0 = llm.engine.stats.steps, llm.engine.stats.extended_tokens
    t0 = time.perf_counter()
    outs = gen(prompts, output_len)
    wall = time.perf_counter() - t0
    ttft = [o.metrics.time_to_first_token for o in outs]
    return dict(
        wall_s=wall, tokens=[list(o.outputs[0].token_ids) for o in outs],
        extra=dict(steps=llm.engine.stats.steps - steps0,
                   extended_tokens=llm.engine.stats.extended_tokens - ext0,
                   cached_prompt_tokens=sum(o.metrics.num_cached_tokens for o in outs),
                   preemptions=sum(o.metrics.num_preemptions for o in outs),
                   mean_ttft_s=sum(ttft) / len(ttft)))


def _hf_model(folder: Path, attn: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation=attn)
    return model.eval()


def run_hf_generate(folder: Path, prompts: list[list[int]], warm: list[list[int]], output_len: int,
                    args: argparse.Namespace) -> dict:
    import torch
    from transformers import GenerationConfig

    model = _hf_model(folder, "sdpa")
    pad = 0

    def gen(ps: list[list[int]], n: int) -> list[list[int]]:
        width = max(len(p) for p in ps)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        # eos_token_id=None: no EOS stopping, so every row generates exactly n tokens (ignore_eos).
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                               pad_token_id=pad, bos_token_id=None)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        return out[:, width:].tolist()

    gen(warm, WARMUP_OUTPUT_LEN)
    t0 = time.perf_counter()
    tokens = gen(prompts, output_len)
    wall = time.perf_counter() - t0
    return dict(wall_s=wall, tokens=tokens, extra=dict(attn="sdpa", cache="DynamicCache"))


def run_hf_generate_batch(folder: Path, prompts: list[list[int]], warm: list[list[int]], output_len: int,
                          args: argparse.Namespace) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = _hf_model(folder, "sdpa")
    max_len = len(prompts[0]) + output_len
    num_blocks = -(-len(prompts) * max_len // args.page_size) + len(prompts)
    cb_cfg = ContinuousBatchingConfig(
        page_size=args.page_size, num_blocks=num_blocks, max_batch_tokens=args.hf_max_batch_tokens,
        max_requests_per_batch=len(prompts), allow_block_sharing=False, use_cuda_graph=False)
    # eos_token_id=-1 disables EOS in continuous batching (ignore_eos).
    gen_cfg = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)

    def gen(ps: list[list[int]], n: int) -> list[list[int]]:
        res = model.generate_batch(inputs=ps, generation_config=gen_cfg, continuous_batching_config=cb_cfg,
                                   max_new_tokens=n, progress_bar=False, warmup=False)
        outs = list(res.values())
        if len(outs) != len(ps) or any(o.error for o in outs):
            raise RuntimeError(f"generate_batch returned {len(outs)}/{len(ps)} results, errors: "
                               f"{[o.error for o in outs if o.error][:3]}")
        return [list(o.generated_tokens) for o in outs]

    gen(warm, WARMUP_OUTPUT_LEN)
    t0 = time.perf_counter()
    tokens = gen(prompts, output_len)
    wall = time.perf_counter() - t0
    return dict(wall_s=wall, tokens=tokens,
                extra=dict(attn=str(model.config._attn_implementation), page_size=args.page_size,
                           num_blocks=num_blocks, max_batch_tokens=args.hf_max_batch_tokens,
                           note="wall time includes manager setup and cache allocation per call"))


RUNNERS = {"ours": run_ours, "hf-generate": run_hf_generate, "hf-generate-batch": run_hf_generate_batch}


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    folder = Path(args.model_folder)
    prompts = make_prompts(args.num_requests, args.prompt_len, args.seed)
    warm = make_prompts(WARMUP_REQUESTS, WARMUP_PROMPT_LEN, args.seed + 1)
    res = RUNNERS[args.worker](folder, prompts, warm, args.output_len, args)
    res["system"] = args.worker
    res["torch_threads"] = torch.get_num_threads()
    Path(args.result).write_text(json.dumps(res))


# ---- the driver ---------------------------------------------------------------------------------

def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--model-preset", default="30m")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    ap.add_argument("--out", help="append one JSON line per system here")
    ap.add_argument("--seed", type=int, default=0, help="model weights and prompt seed")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunked-prefill-size", type=int, default=2048, help="ours: tokens per step")
    ap.add_argument("--hf-max-batch-tokens", type=int, default=256, help="hf-generate-batch: tokens per step")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "tokenrouter-bench"))
    ap.add_argument("--timeout", type=float, default=900, help="seconds per system before it is killed")
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--model-folder", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)}")
    cache_dir = Path(args.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    folder = model_folder(args.model_preset, args.seed, cache_dir)
    print(f"model {folder} | {args.num_requests} requests x {args.prompt_len} prompt + {args.output_len} "
          f"output tokens, greedy, ignore_eos | {cpu_name()}, torch threads 1", flush=True)

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    results: dict[str, dict] = {}
    for system in systems:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            result_path = f.name
        cmd = [sys.executable, __file__, "--worker", system, "--model-folder", str(folder), "--result", result_path]
        for flag in ("num_requests", "prompt_len", "output_len", "seed", "page_size", "chunked_prefill_size",
                     "hf_max_batch_tokens"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        print(f"running {system} ...", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
            ok = proc.returncode == 0
            err = "" if ok else (proc.stderr.strip().splitlines() or ["?"])[-1]
        except subprocess.TimeoutExpired:
            ok, err = False, f"timed out after {args.timeout:.0f} s"
        if ok:
            results[system] = json.loads(Path(result_path).read_text())
            results[system]["process_s"] = time.perf_counter() - t0
        else:
            results[system] = dict(system=system, error=err)
            print(f"  {system} failed: {err}", flush=True)
        os.unlink(result_path)

    ref_name = next((s for s in systems if "tokens" in results[s]), None)
    ref = results[ref_name]["tokens"] if ref_name else None
    out_tokens = args.num_requests * args.output_len
    print()
    print(f"{'system':<20}{'wall s':>9}{'out tok/s':>11}{'exact match vs ' + str(ref_name):>30}")
    rows = []
    for s in systems:
        r = results[s]
        if "tokens" not in r:
            print(f"{s:<20}{'failed':>9}   {r['error']}")
            rows.append(dict(system=s, error=r["error"]))
            continue
        got = sum(len(t) for t in r["tokens"])
        if got != out_tokens:
            print(f"  warning: {s} produced {got} output tokens, expected {out_tokens}")
        tps = got / r["wall_s"]
        same = sum(a == b for a, b in zip(r["tokens"], ref))
        # Mean length of the common prefix with the reference, in tokens.
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                  for a, b in zip(r["tokens"], ref)]
        row = dict(system=s, wall_s=round(r["wall_s"], 3), output_tokens=got, tok_per_s=round(tps, 1),
                   exact_match=f"{same}/{len(ref)}", mean_common_prefix=round(sum(prefix) / len(prefix), 1),
                   process_s=round(r["process_s"], 1), **r.get("extra", {}))
        rows.append(row)
        match = f"{same}/{len(ref)} (prefix {row['mean_common_prefix']})"
        print(f"{s:<20}{r['wall_s']:>9.2f}{tps:>11.1f}{match:>30}")
    tps = {row["system"]: row["tok_per_s"] for row in rows if "tok_per_s" in row}
    if "ours" in tps:
        for s, v in tps.items():
            if s != "ours":
                print(f"ratio ours / {s}: {tps['ours'] / v:.2f}x")
    for row in rows:
        extra = {k: v for k, v in row.items() if k not in ("system", "wall_s", "output_tokens", "tok_per_s",
                                                           "exact_match", "mean_common_prefix")}
        if extra:
            print(f"  {row['system']}: {extra}")
    if args.out:
        meta = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), cpu=cpu_name(), num_requests=args.num_requests,
                    prompt_len=args.prompt_len, output_len=args.output_len, model_preset=args.model_preset,
                    seed=args.seed, torch_threads=1, reference=ref_name)
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps({**meta, **row}) + "\n")


if __name__ == "__main__":
    main()
