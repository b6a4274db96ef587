"""The `tokenrouter` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Solve: 12 * 7 =",
    "Once upon a time",
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as in SGLang (vLLM's names as aliases)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model-path", "--model", dest="model_path", default=None,
                   help="Hugging Face model folder (default: the embedded default model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    g.add_argument("--page-size", "--block-size", dest="page_size", type=int, default=16)
    g.add_argument("--max-running-requests", "--max-num-seqs", dest="max_running_requests", type=int, default=64)
    g.add_argument("--chunked-prefill-size", "--max-num-batched-tokens", dest="chunked_prefill_size",
                   type=int, default=2048)
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool size in tokens")
    g.add_argument("--mem-fraction-static", "--gpu-memory-utilization", dest="mem_fraction", type=float,
                   default=None, help="share of free memory for the KV pool")
    g.add_argument("--context-length", "--max-model-len", dest="max_model_len", type=int, default=None)
    g.add_argument("--disable-radix-cache", "--no-enable-prefix-caching", dest="disable_radix_cache",
                   action="store_true")
    g.add_argument("--attention-backend", default="torch", choices=["torch", "torch-reference"])
    g.add_argument("--num-threads", type=int, default=1,
                   help="torch threads on CPU (default 1; a model takes every core for steps of up to 16 rows while "
                   "no co-located model steps, beside one only at one request: launch.share_cores, --no-share-cores)")
    g.add_argument("--quantization", "-q", default="auto", choices=["auto", "none", "int8"],
                   help="weight-only quantized products for steps of few rows on CPU: auto serves a folder's "
                   "GGUF blocks (model.gguf) as stored, none the float weights, int8 quantizes them per channel")
    g.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
                   help="tensor-parallel ranks (worker processes; gloo on CPU, NCCL on CUDA)")
    g.add_argument("--disable-cuda-graph", "--enforce-eager", dest="disable_cuda_graph", action="store_true",
                   default=None, help="run decode and catch-up steps eagerly (default: compiled per row bucket on "
                   "CUDA, eager on CPU, where it measured slower; TOKENROUTER_DISABLE_CUDA_GRAPH=0 compiles there too)")
    g.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="most new tokens (rows) a compiled step takes (default: --max-running-requests)")
    g.add_argument("--random-seed", dest="seed", type=int, default=0)
    for action in g._group_actions:
        if action.dest not in ("model_path", "seed"):
            _PER_MODEL_FLAGS[action.dest] = (action.option_strings[0], action.default)


# Engine flags that configure one model: {dest: (flag, default)}. A group config sets them per model.
_PER_MODEL_FLAGS: dict[str, tuple[str, object]] = {}


_YAML_FIELD = {"disable_radix_cache": "enable_prefix_cache: false", "num_threads": "threads"}


def _refuse_per_model_flags(args: argparse.Namespace, served: str | None = None) -> None:
    """With --config (or `served`, the group served instead of one model) the engine flags would be
    silently ignored: name the first one given."""
    for dest, (flag, default) in _PER_MODEL_FLAGS.items():
        if getattr(args, dest, default) != default:
            if served is not None:
                raise ValueError(f"{flag} configures one model and has no effect on {served}: give --model-path "
                                 "to serve one model with it")
            raise ValueError(f"{flag} configures one model and has no effect with a group config ({args.config}): "
                             f"set `{_YAML_FIELD.get(dest, dest)}` per model under `models:` in the YAML")


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return dict(
        dtype=args.dtype, device=args.device, page_size=args.page_size,
        max_running_requests=args.max_running_requests, chunked_prefill_size=args.chunked_prefill_size,
        kv_cache_tokens=args.kv_cache_tokens, mem_fraction=args.mem_fraction, max_model_len=args.max_model_len,
        enable_prefix_cache=not args.disable_radix_cache, attention_backend=args.attention_backend,
        seed=args.seed, num_threads=args.num_threads, tp_size=args.tp_size, cuda_graph_max_bs=args.cuda_graph_max_bs,
        quantization=args.quantization,
        # Unset, the EngineConfig default stands (TOKENROUTER_DISABLE_CUDA_GRAPH may set it).
        **({} if args.disable_cuda_graph is None else {"disable_cuda_graph": True}),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenrouter import LLM, SamplingParams
    from tokenrouter.training.default_model import default_model

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed_per_request, stop=args.stop or [],
                            ignore_eos=args.ignore_eos)
    prompts = args.prompt or DEFAULT_PROMPTS
    if args.config:
        return _generate_routed(args, prompts, params)
    model = args.model_path
    if model is None:
        default = default_model()
        print(default.note, file=sys.stderr)
        model = str(default.path)
    llm = LLM(model, **engine_kwargs(args))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    _print_outputs(outputs, elapsed)
    info = llm.engine.info()
    print(f"on {info['device']} {info['dtype']}, model {info['model']}")
    return 0


def _print_outputs(outputs: list, elapsed: float) -> None:
    for out in outputs:
        c = out.outputs[0]
        who = f", by model: {out.extra['tokens_per_model']}" if "tokens_per_model" in out.extra else ""
        print(f"--- prompt: {out.prompt!r}\n{c.text!r}\n[{len(c.token_ids)} tokens, finish: {c.finish_reason}{who}]")
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {n_out} output tokens in {elapsed:.2f} s ({n_out / elapsed:.1f} tok/s)")


def _generate_routed(args: argparse.Namespace, prompts: list[str], params: object) -> int:
    from tokenrouter.routed_llm import RoutedLLM

    with RoutedLLM(load_group(args)) as llm:  # type: ignore[arg-type]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - start
        _print_outputs(outputs, elapsed)
        run = llm.last_run
        if run is not None:
            print(f"tokens per model: {run.tokens_per_model}, hand-offs: {run.handoffs}, "
                  f"mean time PENDING: {run.mean_pending_seconds * 1e3:.2f} ms")
    return 0


def load_group(args: argparse.Namespace) -> object:
    """The group of --config, with --algorithm and --algorithm-param KEY=VALUE overriding its algorithm.

    --algorithm naming another algorithm replaces the config's algorithm section. For a router
    algorithm (CITER, R2R, Co-LLM) the new section takes the router of that kind that the group knows,
    unless --algorithm-param router=PATH gives one: a prepared pair's router (prepared.json next to
    the config, e.g. the default pair) with its served threshold, else the config's `routers:` entry
    (whose algorithm then serves the router's calibrated threshold, as every router algorithm does
    without its knob: routing/deferral.py)."""
    from pathlib import Path

    import yaml

    from tokenrouter.routing import absolute_spec, algorithm_class
    from tokenrouter.runtime.group_config import GroupConfig

    _refuse_per_model_flags(args)
    with open(args.config) as f:
        raw = yaml.safe_load(f) or {}
    algo = raw.get("algorithm", "single")
    algo = dict(algo) if isinstance(algo, dict) else {"name": algo}
    # A relative file spec: from the config's folder in the config, from the working directory on the command line.
    algo["name"] = absolute_spec(str(algo.get("name", "single")), Path(args.config).parent)
    spec = absolute_spec(args.algorithm) if args.algorithm else None
    params = {}
    for item in args.algorithm_param or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--algorithm-param takes KEY=VALUE, got {item!r}")
        params[key] = yaml.safe_load(value)  # numbers, lists and booleans as in the YAML file
    if spec and spec != algo["name"]:
        algo = {"name": spec}
        if algorithm_class(spec).needs_router and "router" not in params:
            algo = _known_router_section(spec, raw, args.config) or algo
    algo.update(params)
    name = algo.get("name", "single")
    if algorithm_class(name).needs_router and not algo.get("router"):
        raise ValueError(f"algorithm {name} needs a trained {name} router, and the group of {args.config} "
                         f"knows none: give one with --algorithm-param router=PATH (a folder made by "
                         f"`tokenrouter train-router --kind {name}`)")
    raw["algorithm"] = algo
    return GroupConfig.from_dict(raw, base=Path(args.config).parent)


def _known_router_section(kind: str, raw: dict, config: str) -> dict | None:
    """The algorithm section for router `kind` from what the group knows (see load_group), or None."""
    import json
    from pathlib import Path

    from tokenrouter.routing.routers import router_meta
    from tokenrouter.training.prepare import served_algorithm

    prepared = Path(config).resolve().parent / "prepared.json"
    if prepared.is_file():
        algo = served_algorithm(json.loads(prepared.read_text()), kind)
        if algo is not None:
            return algo
    path = (raw.get("routers") or {}).get(kind)
    if not path:
        return None
    router_meta(path, kind)  # a missing folder or another kind's router fails here, naming it
    return {"name": kind, "router": str(path)}


def add_group_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file of a routed group; overrides the engine flags")
    p.add_argument("--algorithm", default=None,
                   help="with --config or the default pair: replace the group's routing algorithm (a registered "
                        "name, package.module:Class, or path/to/file.py:Class)")
    p.add_argument("--algorithm-param", action="append", metavar="KEY=VALUE",
                   help="with --config or the default pair: set an algorithm parameter (repeatable), "
                        "e.g. p=0.2 or tau=0.9")


# Load adaptation's flags by the AdaptConfig field each sets (runtime/adapt_config.py).
ADAPT_FLAGS = {"target_tpot_ms": "--target-tpot-ms", "floor": "--adapt-floor", "window": "--adapt-window"}


def add_adapt_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load adaptation")
    g.add_argument("--target-tpot-ms", type=float, default=None,
                   help="hold this p99 time per output token (over each --adapt-window) by moving the routing "
                        "algorithm's share knob toward fewer large-model tokens under load, and back when it falls")
    g.add_argument("--adapt-floor", type=float, default=None,
                   help="the knob value the adaptation stops at (default: about half the served point's "
                        "large-model share; docs/DEPLOYMENT.md)")
    g.add_argument("--adapt-window", type=float, default=None,
                   help="seconds per measurement window; the knob moves once per window (default 10)")


def with_adaptation(group: object, args: argparse.Namespace) -> object:
    """The group with the adaptation flags over its `adapt:` section, checked against its algorithm
    before anything starts; a bad value is refused naming its flag."""
    from tokenrouter.routing import make_algorithm
    from tokenrouter.runtime.adapt_config import AdaptConfig, AdaptConfigError, knob_range

    given = {f: getattr(args, flag[2:].replace("-", "_")) for f, flag in ADAPT_FLAGS.items()}
    given = {f: v for f, v in given.items() if v is not None}
    base = group.adapt  # type: ignore[attr-defined]
    if not given and base is None:
        return group
    try:
        if base is None and "target_tpot_ms" not in given:
            flags = ", ".join(ADAPT_FLAGS[f] for f in given)
            raise AdaptConfigError("target_tpot_ms", f"is needed: {flags} tune the adaptation it turns on")
        cfg = AdaptConfig(**given) if base is None else dataclasses.replace(base, **given)
        algorithm = make_algorithm(group.algorithm, group.names, group.algorithm_params)  # type: ignore[attr-defined]
        knob_range(cfg, algorithm)
    except AdaptConfigError as e:
        flag = e.field in given or base is None  # else the YAML's adapt section set it: name that field
        raise ValueError(f"{ADAPT_FLAGS[e.field]} {e.problem}" if flag else str(e)) from None
    return dataclasses.replace(group, adapt=cfg)  # type: ignore[call-overload]


def group_from_args(args: argparse.Namespace) -> tuple[object, str]:
    """The routed group to serve (a YAML config, or one model from the engine flags) and its name."""
    from tokenrouter.training.default_model import default_model
    from tokenrouter.training.prepare import default_pair_config

    if args.config is None and args.model_path is None:
        pair = default_pair_config()
        if pair is not None:
            print(f"note: no --model-path given; serving the embedded default routed pair ({pair})",
                  file=sys.stderr)
            args.config = str(pair)
            return load_group(args), args.served_model_name or "default"
    if args.config:
        group = load_group(args)
        return group, args.served_model_name or group.name  # type: ignore[attr-defined]
    path = args.model_path
    if path is None:
        default = default_model()
        print(default.note, file=sys.stderr)
        path = str(default.path)
        name = "default"
    else:
        name = os.path.basename(os.path.normpath(path))
    group = one_model_group(args, path, args.served_model_name or name, args.served_model_name or name)
    return group, group.name  # type: ignore[attr-defined]


def one_model_group(args: argparse.Namespace, path: str, model: str, name: str, **engine: object) -> object:
    """The group `name` of one model, `model`, from folder `path` with the engine flags (`engine`
    overrides some)."""
    from tokenrouter.engine.config import EngineConfig
    from tokenrouter.runtime.group_config import GroupConfig, ModelSpec

    kw = {**engine_kwargs(args), **engine}
    if kw["device"] == "auto":
        kw["device"] = "cpu"  # a served model runs where it is told (as a group's models do)
    spec = ModelSpec(name=re.sub(r"[^A-Za-z0-9_-]", "-", model),
                     engine=EngineConfig(model_path=path, **kw))  # type: ignore[arg-type]
    return GroupConfig(models=[spec], algorithm="single", name=name, seed=args.seed)


# SmolLM2's KV pool while it serves alone, as a share of free memory (a served model's default is 0.2 on
# CPU): the preparation needs memory (7 GB at its peak), and the pair's pools are sized from what is
# free when it starts, beside SmolLM2, and kept for the server's life.
ALONE_MEM_FRACTION = 0.05


def default_before_pair(args: argparse.Namespace, tune: Callable[[object], object]) -> tuple[object, object] | None:
    """With no model given (nor --config, nor --wait-for-pair) and the embedded default routed pair not
    prepared yet: SmolLM2 alone, to serve at once, and the PairUpgrade that prepares the pair in a
    process of its own and then switches to it (its group through `tune`, as any served group).
    None otherwise: group_from_args has what to serve."""
    from tokenrouter.server.pair_upgrade import PairUpgrade
    from tokenrouter.training.default_model import ensure_smollm2
    from tokenrouter.training.prepare import default_pair_settings, prepared_config

    if args.config is not None or args.model_path is not None:
        if args.wait_for_pair:
            raise ValueError("--wait-for-pair is for the embedded default routed pair: it has no effect with "
                             "--model-path or --config")
        return None
    if args.wait_for_pair:
        return None
    settings = default_pair_settings()
    if settings is None or prepared_config(settings) is not None:
        return None
    _refuse_per_model_flags(args, "the embedded default routed pair")
    print("note: no --model-path given; SmolLM2-135M-Instruct serves alone while the embedded default routed pair "
          "is prepared in the background, then the pair serves (--wait-for-pair: prepare it first)", file=sys.stderr)
    alone = one_model_group(args, str(ensure_smollm2()), "smollm2", args.served_model_name or "default",
                            mem_fraction=ALONE_MEM_FRACTION)

    def load(config: str) -> object:
        return tune(load_group(argparse.Namespace(**{**vars(args), "config": config})))

    command = [sys.executable, "-m", "tokenrouter.training.background_prepare"]
    return alone, PairUpgrade(command, load, args.restart_on_failure)  # type: ignore[arg-type]


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from tokenrouter.server.app import ServerConfig
    from tokenrouter.server.protocol import RequestLimits
    from tokenrouter.server.serve import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def cores(group: object) -> object:
        if not args.no_share_cores:
            return group
        return dataclasses.replace(group, launch=dataclasses.replace(group.launch, share_cores=False))  # type: ignore

    def tune(group: object) -> object:
        return cores(with_adaptation(group, args))

    before_pair = default_before_pair(args, tune)
    if before_pair is None:
        group, name = group_from_args(args)
        group, upgrade = tune(group), None
    else:  # SmolLM2 alone has no share knob to adapt: the flags are for the pair
        group, upgrade = cores(before_pair[0]), before_pair[1]
        name = args.served_model_name or "default"
    limits = RequestLimits(args.max_prompt_chars, args.max_stop_strings, args.max_stop_chars, args.max_stop_token_ids)
    server_cfg = ServerConfig(name, args.api_key, args.max_body_bytes, args.request_timeout,  # type: ignore[arg-type]
                              limits, args.tokenizer_threads, args.chat_special_tokens, ui=not args.no_ui)
    serve(group, server_cfg, host=args.host, port=args.port, grace_period=args.grace_period,  # type: ignore[arg-type]
          log_level=args.log_level, restart_on_failure=args.restart_on_failure, header_timeout=args.header_timeout,
          upgrade=upgrade)  # type: ignore[arg-type]
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure step latencies of one model and write (or add to) a latency profile."""
    import json
    from pathlib import Path

    from tokenrouter.engine.latency_model import LatencyProfile
    from tokenrouter.engine.profiler import measure

    lat = measure(args.model_path, tuple(args.batch_sizes), context=args.context, steps=args.steps,
                  device=args.device, num_threads=args.num_threads, kv_cache_tokens=args.kv_cache_tokens,
                  page_size=args.page_size, tp_size=args.tp_size)
    out = Path(args.out)
    prof = LatencyProfile.load(out) if out.is_file() else None
    models = dict(prof.models) if prof else {}
    models[args.name] = lat
    merged = LatencyProfile(models, prof.interference if prof else {}, prof.notes if prof else args.notes)
    out.write_text(json.dumps(merged.to_dict(), indent=2))
    for b, sec in lat.table:
        print(f"batch {b:4d}: {sec * 1e3:8.2f} ms per decode step")
    print(f"prefill: {lat.per_token * 1e6:.1f} us per extra token; written to {out} as {args.name!r}")
    return 0


CALIBRATED_NOTE = "# calibrated on-policy:"


def cmd_calibrate(args: argparse.Namespace) -> int:
    """On-policy calibration (training/on_policy.py): the group answers --prompts and its algorithm's
    threshold is searched until the large model writes --target-share of the output tokens."""
    from pathlib import Path

    import yaml

    from tokenrouter.engine.tokenizer import load_tokenizer
    from tokenrouter.training.on_policy import SearchSettings, calibrate_group
    from tokenrouter.training.prompt_file import read_prompts

    if not args.config:
        raise ValueError("calibrate needs --config: the YAML of the routed group to calibrate")
    settings = SearchSettings(target_share=args.target_share, tolerance=args.tolerance,
                              max_iterations=args.max_iterations, max_tokens=args.max_tokens)
    group = load_group(args)
    prompts = read_prompts(args.prompts, load_tokenizer(group.models[0].engine.model_path),  # type: ignore[attr-defined]
                           limit=args.max_prompts)
    print(f"calibrating {group.algorithm} on {len(prompts)} prompts of {args.prompts}: "  # type: ignore[attr-defined]
          f"target large share {settings.target_share:g} +- {settings.tolerance:g}, "
          f"{settings.max_tokens} tokens per answer", file=sys.stderr)
    result = calibrate_group(group, prompts, settings, start=args.start,  # type: ignore[arg-type]
                             log=lambda m: print(m, file=sys.stderr), progress=not args.quiet)
    print(result.summary())
    if not result.reached:
        print(f"tokenrouter: error: calibration missed the target share; the closest measured is {result.param}="
              f"{result.value:.6g} (share {result.share:.3f}). Nothing written. Try more prompts, more "
              "--max-iterations or a wider --tolerance.", file=sys.stderr)
        return 1
    with open(args.config) as f:
        text = f.read()
    raw = yaml.safe_load(text) or {}
    name = args.algorithm or (raw["algorithm"].get("name") if isinstance(raw.get("algorithm"), dict)
                              else raw.get("algorithm"))
    raw.pop("algorithm_params", None)  # its values are in the group's algorithm_params, written below
    raw["algorithm"] = {"name": name, **group.algorithm_params,  # type: ignore[attr-defined]
                        result.param: result.value}
    # the file's leading comment lines stay (YAML drops comments), less an earlier calibration's note
    header = ""
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith(CALIBRATED_NOTE):
            header += line + "\n"
    note = (f"{CALIBRATED_NOTE} {result.param} {result.value:.6g} -> large share {result.share:.3f} "
            f"(target {result.target_share:g}) on {len(prompts)} prompts of {args.prompts}\n")
    out = header + note + yaml.safe_dump(raw, sort_keys=False)
    if args.write or args.out:
        target = Path(args.config if args.write else args.out)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(out)
        tmp.rename(target)
        print(f"written: {target}")
    else:
        print(yaml.safe_dump({"algorithm": raw["algorithm"]}, sort_keys=False), end="")
    return 0


def cmd_convert_router(args: argparse.Namespace) -> int:
    from tokenrouter.routing.r2r_release import convert_r2r_router

    folder = convert_r2r_router(args.checkpoint, args.out, args.r2r_config, args.small, args.large, args.threshold)
    meta = json.loads((folder / "router.json").read_text())
    print(f"wrote {folder}: an r2r router ({meta['source']['model_type']}), threshold {meta['threshold']}; "
          f"serve it with algorithm: {{name: r2r, router: {folder}}}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenrouter", description="Token-level LLM routing server")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions offline with one model")
    add_engine_args(g)
    add_group_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeat for several); default: built-in prompts")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", dest="seed_per_request", type=int, default=None, help="sampling seed for every request")
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="serve the OpenAI-compatible API (one model, or a routed group)")
    add_engine_args(sv)
    add_group_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    sv.add_argument("--served-model-name", default=None, help="the model name clients send")
    sv.add_argument("--grace-period", type=float, default=30.0,
                    help="seconds in-flight requests may finish after SIGTERM before they are aborted")
    sv.add_argument("--log-level", default="info")
    sv.add_argument("--restart-on-failure", action="store_true",
                    help="when a subserver dies, fail its requests (503) and start the group again")
    sv.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    sv.add_argument("--request-timeout", type=float, default=None,
                    help="seconds a request may run before it is aborted (408)")
    sv.add_argument("--max-prompt-chars", type=int, default=1 << 20,
                    help="characters of prompt text (or token ids) a request may send; more get 400")
    sv.add_argument("--max-stop-strings", type=int, default=16, help="stop strings per request; more get 400")
    sv.add_argument("--max-stop-chars", type=int, default=256, help="characters per stop string; longer get 400")
    sv.add_argument("--max-stop-token-ids", type=int, default=256, help="stop_token_ids per request; more get 400")
    sv.add_argument("--tokenizer-threads", type=int, default=2,
                    help="threads that tokenise prompts, off the event loop")
    sv.add_argument("--header-timeout", type=float, default=10.0,
                    help="seconds a connection may take to send a request's headers before it is closed")
    sv.add_argument("--chat-special-tokens", choices=["escape", "allow"], default="escape",
                    help="text in chat content that spells a special token (<|im_end|>, ...): 'escape' "
                         "tokenises it as plain text; 'allow' lets it become the control token (as vLLM does)")
    sv.add_argument("--no-ui", action="store_true",
                    help="do not serve the routing page at / (each token coloured by the model that wrote it)")
    sv.add_argument("--no-share-cores", action="store_true",
                    help="keep each model on its --num-threads (launch.share_cores: false); by default a model on "
                    "CPU runs a step of up to 16 rows on every core while no co-located model steps (beside one, "
                    "only while the group serves one request)")
    sv.add_argument("--wait-for-pair", action="store_true",
                    help="with no model given: prepare the embedded default routed pair first and serve only "
                    "then (by default SmolLM2 serves alone at once while the pair is prepared in the background)")
    add_adapt_args(sv)
    sv.set_defaults(func=cmd_serve)

    pf = sub.add_parser("profile", help="measure a model's step latency into a latency profile (JSON)")
    add_engine_args(pf)
    pf.add_argument("--name", required=True, help="the model's name in the profile")
    pf.add_argument("--out", required=True, help="profile file; an existing one gains or updates this model")
    pf.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    pf.add_argument("--context", type=int, default=128, help="tokens of context per request while decoding")
    pf.add_argument("--steps", type=int, default=10, help="decode steps timed per batch size")
    pf.add_argument("--notes", default="", help="where the figures come from")
    pf.set_defaults(func=cmd_profile)

    cr = sub.add_parser("convert-router",
                        help="convert a router R2R's authors publish (thu-nics/R2R) to a router folder")
    cr.add_argument("checkpoint", help="their router checkpoint (.pt; read with torch.load(weights_only=True))")
    cr.add_argument("--out", required=True, help="the router folder to write (router.safetensors + router.json)")
    cr.add_argument("--r2r-config", default=None, help="their per-pair config (config/SMALL+LARGE.yaml)")
    cr.add_argument("--small", default=None, help="the small model's folder: the router then checks it at bind")
    cr.add_argument("--large", default=None, help="the large model's folder: the router then checks it at bind")
    cr.add_argument("--threshold", type=float, default=None,
                    help="instead of the checkpoint's own (common_args.threshold, what R2R serves with)")
    cr.set_defaults(func=cmd_convert_router)

    cal = sub.add_parser("calibrate", help="search a routed group's threshold until the large model writes a target "
                                           "share of the output tokens on your prompts (on-policy)")
    add_group_args(cal)
    cal.add_argument("--prompts", required=True,
                     help="JSONL with `prompt` (text) or `messages` (a chat, through the chat template) per line, "
                          "or a text file with one prompt per line")
    cal.add_argument("--target-share", type=float, required=True,
                     help="share of output tokens the non-entry (large) model should write, in [0, 1]")
    cal.add_argument("--tolerance", type=float, default=0.025, help="accepted distance from the target share")
    cal.add_argument("--max-tokens", type=int, default=96, help="tokens per greedy answer")
    cal.add_argument("--max-iterations", type=int, default=10, help="probes, each answering every prompt")
    cal.add_argument("--max-prompts", type=int, default=None, help="use the file's first N prompts")
    cal.add_argument("--start", type=float, default=None, help="first threshold probed (default: the group's own)")
    cal.add_argument("--quiet", action="store_true", help="no progress bars")
    where = cal.add_mutually_exclusive_group()
    where.add_argument("--write", action="store_true", help="write the threshold into the --config YAML")
    where.add_argument("--out", default=None, help="write the calibrated group to this YAML instead "
                                                   "(relative paths in it stay relative to where they were)")
    cal.set_defaults(func=cmd_calibrate)

    from tokenrouter.bench.cli import add_bench_parser
    from tokenrouter.planner.cli import add_plan_parser
    from tokenrouter.runtime.subserver.joiner import add_subserver_parser
    from tokenrouter.training.cli import add_train_router_parser
    from tokenrouter.training.evaluation.cli import add_prepare_parsers

    add_plan_parser(sub)
    add_bench_parser(sub)
    add_train_router_parser(sub)
    add_prepare_parsers(sub)
    add_subserver_parser(sub)
    from tokenrouter.bench.baselines.standard import add_standard_parser

    bl = sub.add_parser("baseline", help="baseline systems to compare against (standard serving)")
    add_standard_parser(bl.add_subparsers(dest="baseline_command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and argv[1:2] not in (["run"], ["plot"], ["compare"], ["-h"], ["--help"]):
        argv.insert(1, "run")  # `tokenrouter bench ...` means `tokenrouter bench run ...`
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, OSError) as e:
        print(f"tokenrouter: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
