"""The command line: the main job on the embedded default model, and clear errors."""

from __future__ import annotations

import pytest

from tokenrouter import cli
from tokenrouter.routing import make_algorithm
from tokenrouter.training.default_model import RANDOM_WEIGHTS_WARNING, SMOLLM2_NOTE, ensure_random_model


def test_generate_on_default_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    monkeypatch.setenv("TOKENROUTER_DEFAULT_MODEL", "random")
    rc = cli.main(["generate", "--max-tokens", "5", "--prompt", "hi", "--prompt", "there", "--quiet",
                   "--ignore-eos", "--kv-cache-tokens", "1024"])
    out = capsys.readouterr()
    assert rc == 0
    assert RANDOM_WEIGHTS_WARNING in out.err
    assert "2 requests, 10 output tokens" in out.out
    assert (tmp_path / "models").is_dir()


def test_default_model_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path / "a"))
    a = (ensure_random_model() / "model.safetensors").read_bytes()
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path / "b"))
    b = (ensure_random_model() / "model.safetensors").read_bytes()
    assert a == b
    assert ensure_random_model() == tmp_path / "b" / "models" / ensure_random_model().name  # cached


def test_default_model_is_smollm2_when_installed(tmp_path, monkeypatch, capsys, smollm2_gguf):
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    monkeypatch.delenv("TOKENROUTER_DEFAULT_MODEL", raising=False)
    rc = cli.main(["generate", "--max-tokens", "4", "--prompt", "The capital of France is", "--quiet",
                   "--kv-cache-tokens", "2048"])
    out = capsys.readouterr()
    assert rc == 0 and SMOLLM2_NOTE in out.err
    assert "Paris" in out.out  # real weights: real text


def test_bad_model_path_is_a_clear_error(tmp_path, capsys):
    rc = cli.main(["generate", "--model-path", str(tmp_path / "nope"), "--quiet"])
    assert rc == 2
    assert "is not a folder" in capsys.readouterr().err


def test_bad_sampling_flag_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    monkeypatch.setenv("TOKENROUTER_DEFAULT_MODEL", "random")
    rc = cli.main(["generate", "--max-tokens", "0", "--quiet", "--kv-cache-tokens", "512"])
    assert rc == 2
    assert "max_tokens" in capsys.readouterr().err


def test_generate_with_a_routed_group(tmp_path, pair_paths, capsys):
    cfg = tmp_path / "group.yaml"
    cfg.write_text(
        "models:\n"
        f"  - {{name: small, path: {pair_paths['small']}, kv_cache_tokens: 1024, page_size: 4}}\n"
        f"  - {{name: large, path: {pair_paths['large']}, kv_cache_tokens: 1024, page_size: 4}}\n"
        "algorithm: {name: bernoulli, p: 0.5}\n")
    rc = cli.main(["generate", "--config", str(cfg), "--max-tokens", "8", "--ignore-eos", "--quiet",
                   "--prompt", "hello"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "1 requests, 8 output tokens" in out
    assert "tokens per model:" in out and "hand-offs:" in out


def test_algorithm_parameters_from_the_command_line(tmp_path, pair_paths, capsys):
    cfg = tmp_path / "group.yaml"
    cfg.write_text(
        "models:\n"
        f"  - {{name: small, path: {pair_paths['small']}, kv_cache_tokens: 1024, page_size: 4}}\n"
        f"  - {{name: large, path: {pair_paths['large']}, kv_cache_tokens: 1024, page_size: 4}}\n"
        "algorithm: {name: bernoulli, p: 0.0}\n")
    base = ["generate", "--config", str(cfg), "--max-tokens", "8", "--ignore-eos", "--quiet", "--prompt", "hi"]
    assert cli.main(base) == 0
    assert "hand-offs: 0," in capsys.readouterr().out
    assert cli.main(base + ["--algorithm-param", "p=1.0"]) == 0
    assert "'large': 8" in capsys.readouterr().out  # every token rewritten by the large model
    assert cli.main(base + ["--algorithm", "ensemble", "--algorithm-param", "weights=[0.5, 0.5]"]) == 0
    assert cli.main(base + ["--algorithm-param", "p"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def prepared_pair(folder, pair_paths, routers: dict, thresholds: dict):
    """A pair folder as `tokenrouter prepare` leaves it (pair.yaml serving R2R, prepared.json with the
    served thresholds), with the tiny test pair and untrained routers instead of the slow preparation."""
    import json

    import yaml

    from tokenrouter.training.prepare import group_dict

    folder.mkdir(parents=True, exist_ok=True)
    group = group_dict(pair_paths["small"], pair_paths["large"], routers, thresholds, "r2r")
    for m in group["models"]:
        m.update(kv_cache_tokens=1024, page_size=4)
    (folder / "pair.yaml").write_text(yaml.safe_dump(group, sort_keys=False))
    (folder / "prepared.json").write_text(json.dumps({
        "large": str(pair_paths["large"]), "small": str(pair_paths["small"]),
        "routers": {k: str(v) for k, v in routers.items()}, "thresholds": thresholds}))
    return folder / "pair.yaml"


def test_algorithm_flag_takes_the_prepared_pairs_router(tmp_path, pair_paths, monkeypatch, capsys):
    import argparse

    from routing_utils import untrained_routers

    routers = untrained_routers(pair_paths, tmp_path / "routers")
    thresholds = {"citer": 0.3, "r2r": 0.6, "co_llm": 0.4}
    cfg = prepared_pair(tmp_path / "pair", pair_paths, {k: routers[k] for k in ("citer", "r2r")},
                        {k: thresholds[k] for k in ("citer", "r2r")})

    def group(algorithm, *params):
        return cli.load_group(argparse.Namespace(config=str(cfg), algorithm=algorithm, algorithm_param=list(params)))

    # Each router at the pair's served threshold for it (in the kind's own parameter).
    g = group("citer")
    assert g.algorithm == "citer"
    assert g.algorithm_params == {"router": str(routers["citer"]), "tau": 0.3}
    make_algorithm(g.algorithm, g.names, g.algorithm_params)
    g = group("r2r")  # the config's own algorithm: its section stays
    assert g.algorithm_params == {"router": str(routers["r2r"]), "threshold": 0.6}
    assert group("citer", "tau=0.9").algorithm_params["tau"] == 0.9
    # No Co-LLM router in this pair: a clear error that says how to give one, unless one is given.
    with pytest.raises(ValueError, match=r"co_llm needs a trained co_llm router.*--algorithm-param router=PATH"):
        group("co_llm")
    g = group("co_llm", f"router={routers['co_llm']}")
    assert g.algorithm_params == {"router": str(routers["co_llm"])}
    make_algorithm(g.algorithm, g.names, g.algorithm_params)
    assert group("r_stitch").algorithm_params == {}

    # The default-pair path of `serve` (no --config, no --model-path) goes through the same lookup.
    monkeypatch.setattr("tokenrouter.training.prepare.default_pair_config", lambda: cfg)
    args = cli.build_parser().parse_args(["serve", "--algorithm", "citer"])
    g, name = cli.group_from_args(args)
    assert name == "default" and g.algorithm == "citer" and g.algorithm_params["router"] == str(routers["citer"])
    capsys.readouterr()

    # And it serves: CITER on the pair, end to end.
    rc = cli.main(["generate", "--config", str(cfg), "--algorithm", "citer", "--max-tokens", "6", "--ignore-eos",
                   "--quiet", "--prompt", "hi"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "1 requests, 6 output tokens" in out.out and "tokens per model:" in out.out
    assert cli.main(["generate", "--config", str(cfg), "--algorithm", "co_llm", "--quiet", "--prompt", "hi"]) == 2
    assert "--algorithm-param router=PATH" in capsys.readouterr().err


def test_algorithm_flag_takes_a_router_the_config_lists(tmp_path, pair_paths):
    import argparse

    from routing_utils import untrained_routers

    routers = untrained_routers(pair_paths, tmp_path / "routers", threshold=0.25)
    cfg = tmp_path / "group.yaml"
    cfg.write_text(
        "models:\n"
        f"  - {{name: small, path: {pair_paths['small']}}}\n"
        f"  - {{name: large, path: {pair_paths['large']}}}\n"
        "algorithm: {name: bernoulli, p: 0.0}\n"
        f"routers: {{co_llm: {routers['co_llm']}, r2r: {routers['r2r']}}}\n")
    g = cli.load_group(argparse.Namespace(config=str(cfg), algorithm="co_llm", algorithm_param=[]))
    assert g.algorithm_params == {"router": str(routers["co_llm"])}
    assert make_algorithm(g.algorithm, g.names, g.algorithm_params).eta == 0.25  # the router's calibrated one
    g = cli.load_group(argparse.Namespace(config=str(cfg), algorithm="r2r", algorithm_param=[]))
    assert make_algorithm(g.algorithm, g.names, g.algorithm_params).threshold == 0.25
    with pytest.raises(ValueError, match="citer needs a trained citer router"):
        cli.load_group(argparse.Namespace(config=str(cfg), algorithm="citer", algorithm_param=[]))
    cfg.write_text(cfg.read_text().replace("co_llm:", "magic:"))
    with pytest.raises(ValueError, match="unknown router kind"):
        cli.load_group(argparse.Namespace(config=str(cfg), algorithm=None, algorithm_param=[]))


def test_a_router_algorithm_without_its_knob_serves_the_calibrated_threshold(tmp_path, pair_paths):
    """One rule wherever the section comes from: a YAML section naming only the router, the
    --algorithm flag finding it in `routers:`, or the algorithm built directly, serve the threshold in
    the router's router.json; a value given (YAML, flag) serves instead."""
    import argparse

    from routing_utils import untrained_routers

    routers = untrained_routers(pair_paths, tmp_path / "routers", threshold=0.25)
    models = [str(pair_paths["small"]), str(pair_paths["large"])]
    for kind, knob in (("citer", "tau"), ("co_llm", "eta"), ("r2r", "threshold")):
        assert getattr(make_algorithm(kind, models, {"router": str(routers[kind])}), knob) == 0.25
        assert getattr(make_algorithm(kind, models, {"router": str(routers[kind]), knob: 0.5}), knob) == 0.5
        cfg = tmp_path / f"{kind}.yaml"
        cfg.write_text(
            "models:\n"
            f"  - {{name: small, path: {pair_paths['small']}}}\n"
            f"  - {{name: large, path: {pair_paths['large']}}}\n"
            f"algorithm: {{name: {kind}, router: {routers[kind]}}}\n")
        g = cli.load_group(argparse.Namespace(config=str(cfg), algorithm=None, algorithm_param=[]))
        assert getattr(make_algorithm(g.algorithm, g.names, g.algorithm_params), knob) == 0.25
        g = cli.load_group(argparse.Namespace(config=str(cfg), algorithm=None, algorithm_param=[f"{knob}=0.7"]))
        assert getattr(make_algorithm(g.algorithm, g.names, g.algorithm_params), knob) == 0.7
    # A `routers:` entry holding another kind's router is refused when the flag picks it, naming both.
    cfg.write_text(cfg.read_text().replace("algorithm: {name: r2r,", "routers: {citer: " + str(routers["r2r"]) + "}\n"
                                           "algorithm: {name: r2r,"))
    with pytest.raises(ValueError, match="holds a 'r2r' router, not a 'citer' one"):
        cli.load_group(argparse.Namespace(config=str(cfg), algorithm="citer", algorithm_param=[]))


def test_engine_flags_with_a_group_config_are_refused(tmp_path, pair_paths, capsys):
    """An engine flag would be ignored under --config (each model's engine comes from the YAML): it is
    refused, naming the flag and the YAML field to set instead."""
    cfg = tmp_path / "group.yaml"
    cfg.write_text(f"models:\n  - {{name: small, path: {pair_paths['small']}}}\n")
    assert cli.main(["generate", "--config", str(cfg), "--page-size", "4", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--page-size" in err and "page_size" in err and "models:" in err
    assert cli.main(["serve", "--config", str(cfg), "--num-threads", "2"]) == 2
    assert "`threads`" in capsys.readouterr().err
