"""Subservers started by hand (`tokenrouter subserver --join`), on loopback with tcp and a shared secret:
the entry waits for them (bounded), refuses a wrong secret or a wrong model with a clear error, serves
routed completions through a joined model exactly as through a spawned one, and leaves no process."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tokenrouter import SamplingParams
from tokenrouter.bench.server_process import ManagedProcess, alive, free_port
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.runtime.entry.entry import SubserverDied
from tokenrouter.runtime.entry.join_desk import JoinDesk
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import Join
from tokenrouter.runtime.model_identity import ModelIdentity

SECRET = "correct horse battery staple"


def group(pair_paths, port: int, **extra) -> dict:
    return {"name": "pair",
            "models": [{"name": "small", "path": str(pair_paths["small"]), "kv_cache_tokens": 2048, "page_size": 4},
                       {"name": "large", "path": str(pair_paths["large"]), "kv_cache_tokens": 2048, "page_size": 4,
                        "start": "join"}],
            "algorithm": {"name": "bernoulli", "p": 0.5}, "transport": "tcp", "secret": SECRET,
            "entry_port": port, "join_timeout": 120, **extra}


def joiner(name: str, port: int, model: Path, log_dir: Path, secret: str = SECRET, as_model: str = "large",
           timeout: float = 60) -> ManagedProcess:
    cmd = [sys.executable, "-m", "tokenrouter.cli", "subserver", "--join", f"127.0.0.1:{port}", "--name", as_model,
           "--model", str(model), "--join-timeout", str(timeout)]
    return ManagedProcess(name, cmd, 0, log_dir, env={"TOKENROUTER_SECRET": secret})


def test_join_desk_checks_name_vocabulary_and_model(pair_paths):
    cfg = GroupConfig.from_dict(group(pair_paths, 5555))
    large = ModelIdentity.from_folder(pair_paths["large"])
    desk = JoinDesk(cfg, None, None, large.vocab_hash)  # type: ignore[arg-type]
    assert desk.check(Join("large", "tcp://h:1", large, "h")) is None
    assert "no model 'small' waiting to join; it waits for: large" in desk.check(Join("small", "tcp://h:1", large, "h"))
    wrong_vocab = Join("large", "tcp://h:1", _with(large, vocab_hash="0" * 16), "h")
    assert "vocabulary differs" in desk.check(wrong_vocab)
    small = ModelIdentity.from_folder(pair_paths["small"])
    reason = desk.check(Join("large", "tcp://h:1", small, "h"))
    assert "another model than the config names for 'large'" in reason and "num_layers 3 != 2" in reason


def _with(identity: ModelIdentity, **changes) -> ModelIdentity:
    import msgspec

    return msgspec.structs.replace(identity, **changes)


def test_entry_gives_up_on_a_model_that_never_joins(pair_paths):
    cfg = group(pair_paths, free_port(), join_timeout=1.0)
    with pytest.raises(SubserverDied, match=r"model\(s\) large did not join within 1 s: on its host run "
                                            r"`tokenrouter subserver --join tcp://127.0.0.1:\d+ --name NAME`"):
        RoutedLLM(cfg)


def test_joined_model_is_token_exact(pair_paths, tmp_path):
    """The same seeded requests through a joined large model and a spawned one: the same tokens, written
    by the same models."""
    port = free_port()
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5]]
    local = {**group(pair_paths, 0), "models": [dict(m, start="spawn") for m in group(pair_paths, 0)["models"]]}
    with RoutedLLM(local) as llm:
        want = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=60)
    proc = joiner("large", port, pair_paths["large"], tmp_path)
    try:
        with RoutedLLM(group(pair_paths, port)) as llm:
            got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=60)
        assert proc.proc.wait(30) == 0, proc.log_tail()  # the entry ended the session: a clean exit
    finally:
        proc.stop()
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].token_models == b.outputs[0].token_models
    assert {"small", "large"} <= {m for o in got for m in o.outputs[0].token_models}


def test_serve_with_a_joined_model(pair_paths, tmp_path):
    """`tokenrouter serve` waits for the joiner; strangers are refused with the reason; a routed
    completion comes back; stopping the server ends the joiner too."""
    port = free_port()
    cfg = tmp_path / "group.yaml"
    cfg.write_text(yaml.safe_dump(group(pair_paths, port)))
    http = free_port()
    serve = ManagedProcess("serve", [sys.executable, "-m", "tokenrouter.cli", "serve", "--config", str(cfg), "--port",
                                     str(http), "--log-level", "warning"], http, tmp_path,
                           env={"TOKENROUTER_SECRET": SECRET})
    procs = [serve]
    try:
        stranger = joiner("stranger", port, pair_paths["large"], tmp_path, secret="not the group's secret!",
                          timeout=20)
        procs.append(stranger)
        assert stranger.proc.wait(60) == 2
        assert "refused the handshake: the shared secret differs" in stranger.log_tail()

        impostor = joiner("impostor", port, pair_paths["small"], tmp_path)
        procs.append(impostor)
        assert impostor.proc.wait(60) == 2
        assert "the entry refused model 'large': it serves another model" in impostor.log_tail()

        large = joiner("large", port, pair_paths["large"], tmp_path)
        procs.append(large)
        serve.wait_healthy(120)
        body = {"model": "pair", "prompt": [3, 4, 5], "max_tokens": 8, "temperature": 0, "seed": 1}
        r = httpx.post(f"{serve.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        metrics = httpx.get(f"{serve.url}/metrics", timeout=10).text
        assert 'tokenrouter_generated_tokens_total{model="large"}' in metrics
        assert "refused a subserver from" in serve.log_tail(20000)

        pids = serve.alive_pids()
        assert serve.stop() == 0
        assert large.proc.wait(30) == 0, large.log_tail()
        assert not [p for p in pids if alive(p)]
    finally:
        for p in procs:
            p.stop()
    assert not [p for proc in procs for p in proc.alive_pids()]
