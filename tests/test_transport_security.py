"""The tcp transport with a shared secret: CURVE-encrypted sockets that refuse peers without it."""

from __future__ import annotations

import time

import pytest
import zmq

from tokenrouter import SamplingParams
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import Shutdown, encode
from tokenrouter.runtime.transport_security import _OnlyOurClients, keys_from_secret, secure_client

SECRET = "correct horse battery staple"


def group(pair_paths, **extra) -> dict:
    return {"models": [{"name": n, "path": str(p), "kv_cache_tokens": 2048, "page_size": 4}
                       for n, p in pair_paths.items()],
            "algorithm": {"name": "bernoulli", "p": 0.5}, "transport": "tcp", **extra}


def test_keys_come_from_the_secret():
    a, b = keys_from_secret(SECRET), keys_from_secret(SECRET)
    assert a == b and a.server_public != a.client_public
    assert keys_from_secret(SECRET + "!") != a
    with pytest.raises(ValueError, match="at least 16"):
        keys_from_secret("short")


def test_the_zap_check_accepts_our_client_key_alone():
    keys = keys_from_secret(SECRET)
    check = _OnlyOurClients(keys.client_public)
    assert check.callback("*", keys.client_public)
    assert not check.callback("*", keys_from_secret(SECRET + "!").client_public)
    assert not check.callback("*", keys.server_public) and not check.callback("*", b"")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0"])
def test_tcp_needs_a_secret_on_any_interface(pair_paths, monkeypatch, host):
    monkeypatch.delenv("TOKENROUTER_SECRET", raising=False)
    cfg = group(pair_paths)
    cfg["models"][1]["host"] = host
    with pytest.raises(ValueError, match="transport: tcp needs a shared secret .* even on loopback"):
        GroupConfig.from_dict(cfg)
    GroupConfig.from_dict({**cfg, "secret": SECRET})  # fine with one
    monkeypatch.setenv("TOKENROUTER_SECRET", SECRET)
    assert GroupConfig.from_dict(cfg).secret == SECRET  # or from the environment
    assert GroupConfig.from_dict({k: v for k, v in cfg.items() if k != "transport"}).transport == "ipc"  # needs none


def rogue_shutdown(address: str, secret: str | None = None) -> None:
    """A process connects to a subserver's inbox and asks it to shut down (with the group's keys when
    given the secret, as any process of the group could)."""
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.PUSH)
    rogue.setsockopt(zmq.LINGER, 1000)
    secure_client(rogue, keys_from_secret(secret) if secret else None)
    rogue.connect(address)
    try:
        rogue.send(encode(Shutdown()), zmq.NOBLOCK)
    except zmq.Again:
        pass  # no handshake, so no queue: the message never leaves
    time.sleep(1.0)
    rogue.close()
    ctx.term()


def test_secured_group_serves_and_refuses_strangers(pair_paths):
    params = SamplingParams(max_tokens=10, temperature=0.0, seed=4, ignore_eos=True)
    default = {k: v for k, v in group(pair_paths).items() if k != "transport"}
    with RoutedLLM(default) as plain:  # ipc by default: unix sockets, unreachable from other machines
        assert all(r.address.startswith("ipc://") for r in plain.entry.info.values())
        assert plain.entry.entry_address.startswith("ipc://")
        want = plain.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=params, use_tqdm=False, timeout=60)
    with RoutedLLM(group(pair_paths, secret=SECRET)) as llm:
        out = llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=params, use_tqdm=False, timeout=60)
        assert out[0].outputs[0].token_ids == want[0].outputs[0].token_ids
        assert out[0].outputs[0].token_models == want[0].outputs[0].token_models
        rogue_shutdown(llm.entry.info["large"].address, secret="not the group's secret!")
        rogue_shutdown(llm.entry.info["large"].address)
        assert all(p.is_alive() for p in llm.entry.procs.values())
        again = llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=params, use_tqdm=False, timeout=60)
        assert again[0].outputs[0].token_ids == want[0].outputs[0].token_ids
        # The control: with the group's keys the same message arrives and the subserver stops, so the
        # strangers above were refused by the handshake, not missed.
        rogue_shutdown(llm.entry.info["large"].address, secret=SECRET)
        llm.entry.procs["large"].join(10)
        assert not llm.entry.procs["large"].is_alive()
