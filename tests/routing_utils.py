"""Helpers for the routed-runtime tests: a tiny model pair, group configs, routing-draw lookups, and an
in-process rig that drives two Subservers by hand (no processes) with the test acting as the entry."""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from tokenrouter.engine.req import Req
from tokenrouter.routing.bernoulli import hands_off
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import Abort, AddReq, Finished, Handoff, Peer, Tokens, Topology, decode, encode
from tokenrouter.runtime.subserver.subserver import Subserver
from tokenrouter.sampling_params import SamplingParams

PAGE = 4


def build_pair(root: Path) -> dict[str, Path]:
    """A small and a larger random llama with the same byte-level tokenizer (vocab 320, context 512)."""
    from tokenrouter.models.random_model import build_random_model

    return {
        "small": build_random_model(root / "small", "llama", "tiny", seed=1),
        "large": build_random_model(root / "large", "llama", "tiny", seed=2, hidden_size=128, num_hidden_layers=3),
    }


def group_dict(paths: dict[str, Path], p: float, kv_tokens: int = 2048, engine: dict[str, Any] | None = None,
               large: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """`engine`: more engine keys for both models (e.g. chunked_prefill_size); `large`: for the large
    model only (e.g. tp_size)."""
    return {
        "models": [
            {"name": n, "path": str(paths[n]), "kv_cache_tokens": kv_tokens, "page_size": PAGE, **(engine or {}),
             **((large or {}) if n == "large" else {})}
            for n in ("small", "large")
        ],
        "algorithm": {"name": "bernoulli", "p": p},
        **extra,
    }


def untrained_routers(paths: dict[str, Path], root: Path, threshold: float = 0.5) -> dict[str, Path]:
    """Untrained CITER, R2R and Co-LLM router folders for the pair of `paths` (its fingerprints), for
    tests of how routers are found and loaded rather than of what they decide."""
    import json

    import torch
    from safetensors.torch import load_file

    from tokenrouter.routing.routers import CiterRouter, DeferralHead, R2RRouter, model_fingerprint, save_router

    def fingerprint(path: Path) -> str:
        cfg = json.loads((path / "config.json").read_text())
        return model_fingerprint(cfg, load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"])

    hidden = json.loads((paths["small"] / "config.json").read_text())["hidden_size"]
    pair = {role: {"fingerprint": fingerprint(paths[role])} for role in ("small", "large")}
    torch.manual_seed(0)
    heads = {"citer": CiterRouter(hidden), "r2r": R2RRouter(hidden, top_k=8, width=32, blocks=2),
             "co_llm": DeferralHead(hidden)}
    return {kind: save_router(root / kind, head.eval(), threshold=threshold, pair=pair) for kind, head in heads.items()}


def handoff_draws(seed: int, first: int, count: int, p: float) -> list[bool]:
    """Whether the bernoulli router hands position first + i to the large model, for i < count."""
    return hands_off([seed] * count, list(range(first, first + count)), p).tolist()


def find_seed(pattern: list[bool], first: int, p: float, limit: int = 20_000) -> int:
    """The smallest request seed whose hand-off draws at positions first, first+1, ... match pattern."""
    for seed in range(limit):
        if handoff_draws(seed, first, len(pattern), p) == pattern:
            return seed
    raise AssertionError(f"no seed below {limit} gives the draws {pattern}")


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 10.0, pause: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(pause)


class Rig:
    """Two Subservers in this process, driven step by step; the test is the entry.

    Nothing runs unless the test calls drain/step: zmq only carries the bytes. Every wait is bounded.
    """

    def __init__(self, paths: dict[str, Path], p: float, eos_large: set[int] | None = None, **group_extra: Any):
        self.dir = tempfile.mkdtemp(prefix="trh-", dir="/tmp")  # ipc paths must stay short
        tag = uuid.uuid4().hex[:6]
        self.group = GroupConfig.from_dict(group_dict(paths, p, **group_extra))
        self.entry_address = f"ipc://{self.dir}/entry-{tag}"
        self.ctx = zmq.Context()
        self.entry = self.ctx.socket(zmq.PULL)
        self.entry.bind(self.entry_address)
        self.subs: dict[str, Subserver] = {}
        self.out: dict[str, zmq.Socket] = {}
        self.msgs: list[Any] = []  # every message the entry received, in arrival order
        try:
            for name in self.group.names:
                bind = f"ipc://{self.dir}/{name}-{tag}"
                self.subs[name] = Subserver(self.group.spec(name), self.group, bind, self.entry_address)
            for name, sub in self.subs.items():
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(sub.io.address)
                self.out[name] = sock
            # As the entry does once every model is ready: tell each where its peers listen.
            topology = Topology({n: s.io.address for n, s in self.subs.items()})
            for name, sub in self.subs.items():
                self.send(name, topology)
                peers = set(self.subs) - {name}
                self.drain_until(name, lambda sub=sub, peers=peers: set(sub.io.to_peer) == peers, "topology")
        except BaseException:
            self.close()
            raise

    @property
    def small(self) -> Subserver:
        return self.subs["small"]

    @property
    def large(self) -> Subserver:
        return self.subs["large"]

    # ---- the test as the entry -----------------------------------------------------------
    def add(self, rid: str, tokens: list[int], seed: int, trace: bool = False, **params: Any) -> None:
        """`trace`: the request asks for a per-token trace (`routing.trace`)."""
        params.setdefault("temperature", 0.0)
        params.setdefault("ignore_eos", True)
        self.send("small", AddReq(rid, list(tokens), SamplingParams(**params), seed, trace=trace))
        self.drain_until("small", lambda: rid in self.small.engine.reqs, f"{rid} added on small")

    def send(self, name: str, msg: Any) -> None:
        self.out[name].send(encode(msg))

    def abort(self, rid: str) -> None:
        for name in self.group.names:
            self.send(name, Abort(rid))

    def collect(self, timeout_ms: int = 0) -> list[Any]:
        """Entry messages that arrived so far (waits up to timeout_ms for the first one)."""
        new = []
        if self.entry.poll(timeout_ms):
            while True:
                try:
                    new.append(decode(self.entry.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        self.msgs.extend(new)
        return new

    def finished(self, rid: str) -> list[Finished]:
        return [m for m in self.msgs if isinstance(m, Finished) and m.rid == rid]

    def tokens(self, rid: str) -> list[tuple[str, int, int]]:
        """(model, position, token) of every token event of rid the entry received."""
        return [(m.model, e.pos, e.token) for m in self.msgs if isinstance(m, Tokens) for e in m.items if e.rid == rid]

    def wait_entry(self, cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            self.collect(20)

    # ---- driving the subservers ------------------------------------------------------------
    def drain_until(self, name: str, cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        sub = self.subs[name]
        deadline = time.monotonic() + timeout
        while True:
            sub._drain(timeout_ms=20)
            if cond():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what} on {name}")

    def take_inbox(self, name: str, timeout: float = 10.0) -> bytes:
        """Pull the next raw message off a subserver's inbox without handling it (to hold it in flight)."""
        sock = self.subs[name].io.inbox
        if not sock.poll(int(timeout * 1000)):
            raise AssertionError(f"no message reached {name} within {timeout} s")
        return sock.recv()

    def req(self, name: str, rid: str) -> Req | None:
        return self.subs[name].engine.reqs.get(rid)

    def step(self, name: str) -> None:
        """One step, its messages sent (the loop sends them during the next step or before it waits)."""
        self.subs[name]._step()
        self.subs[name].io.flush()

    def pump(self, done: Callable[[], bool], what: str, max_rounds: int = 2000, timeout: float = 30.0) -> None:
        """Run both subservers (drain, step) until done(); bounded in rounds and time."""
        deadline = time.monotonic() + timeout
        for _ in range(max_rounds):
            self.collect(0)
            if done():
                return
            if time.monotonic() > deadline:
                break
            busy = any(s.engine.scheduler.has_work() for s in self.subs.values())
            for sub in self.subs.values():
                sub._drain(timeout_ms=0 if busy else 5)
                sub.states.check_integrity(sub.engine.reqs)  # hand-off state matches the live requests, mid-flight too
                if sub.engine.scheduler.has_work():
                    sub._step()
        raise AssertionError(f"pump: {what} not reached within {max_rounds} rounds / {timeout} s")

    def settle(self, rounds: int = 5) -> None:
        """Drain both inboxes a few times (finish notices, aborts) without stepping."""
        for _ in range(rounds):
            for sub in self.subs.values():
                sub._drain(timeout_ms=10)
        self.collect(0)

    # ---- checks ------------------------------------------------------------------------------
    def assert_clean(self, name: str) -> None:
        """No live request and no page held outside the free list and the (unlocked) prefix cache."""
        eng = self.subs[name].engine
        self.subs[name].check_integrity()
        assert not eng.reqs, f"{name} still holds {sorted(eng.reqs)}"
        assert not eng.scheduler.running and not eng.scheduler.waiting, f"{name} scheduler not empty"
        assert eng.cache.locked_pages == 0, f"{name}: {eng.cache.locked_pages} cache pages still locked"
        assert eng.pool.num_free + eng.cache.total_pages == eng.pool.num_pages, f"{name}: pages leaked"

    def close(self) -> None:
        for sub in self.subs.values():
            sub.engine.abort_all()
            sub.close()
        for sock in (self.entry, *self.out.values()):
            sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


def peer_msgs(raw: bytes) -> Peer:
    msg = decode(raw)
    assert isinstance(msg, Peer), f"expected a Peer message, got {type(msg).__name__}"
    return msg


def only(msg: Peer) -> Handoff:
    """The one hand-off a Peer message carries (these tests hand off one request a step)."""
    assert len(msg.items) == 1, f"expected one hand-off, got {len(msg.items)}"
    return msg.items[0]


# A user's routing algorithm, as a plug-in file: Bernoulli routing that raises in the stage a request's
# own routing parameter `fail_in` names (route, send, receive, on_start, on_finish).
PICKY_SOURCE = '''
from tokenrouter.routing.bernoulli import Bernoulli


class Picky(Bernoulli):
    name = "picky"
    request_params = ("p", "fail_in")

    def __init__(self, models, p=0.5, fail_in=""):
        super().__init__(models, p)
        self.fail_in = fail_in

    @classmethod
    def check_request_value(cls, field, value):
        return value if field == "fail_in" else super().check_request_value(field, value)

    def _check(self, rid, stage):
        # A peer's first hand-off reaches receive before on_start: no parameters yet, nothing to check.
        if self.params_of.get(rid, {}).get("fail_in") == stage:
            raise RuntimeError(f"picky cannot {stage} request {rid}")

    def route(self, model, step):
        for req in step.reqs:
            self._check(req.rid, "route")
        return super().route(model, step)

    def send(self, req, dest, known):
        self._check(req.rid, "send")
        return super().send(req, dest, known)

    def receive(self, peer, model):
        self._check(peer.rid, "receive")
        return super().receive(peer, model)

    def on_start(self, req):
        self._check(req.rid, "on_start")

    def on_finish(self, req):
        self._check(req.rid, "on_finish")
'''


def write_picky(folder: Path) -> str:
    """Write the Picky plug-in into `folder`; its algorithm spec."""
    path = Path(folder) / "picky.py"
    path.write_text(PICKY_SOURCE)
    return f"{path}:Picky"
