"""The entry's side of `tokenrouter subserver --join`: a subserver started by hand on another host says
which model it serves; the entry checks that against the config (a model marked `start: join` that
has not joined yet, the entry model's vocabulary, and the config's model where its folder is readable
here) and answers Welcome, with the group config to serve, or Refused, with the reason."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import zmq

from tokenrouter.runtime.connection_watch import ConnectionWatch
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import Join, Refused, Welcome, encode
from tokenrouter.runtime.model_identity import ModelIdentity
from tokenrouter.runtime.transport_security import CurveKeys, secure_client

logger = logging.getLogger(__name__)


class JoinDesk:
    def __init__(self, group: GroupConfig, ctx: zmq.Context, keys: CurveKeys | None, vocab_hash: str) -> None:
        self.group, self.ctx, self.keys, self.vocab_hash = group, ctx, keys, vocab_hash
        self.waiting = [m.name for m in group.models if m.start == "join"]
        self.joined: dict[str, tuple[float, str]] = {}  # model -> (when, the joiner's inbox address)

    def check(self, msg: Join) -> str | None:
        """Why this joiner cannot serve, or None."""
        if msg.model in self.joined:
            return f"model {msg.model!r} has already joined (from {self.joined[msg.model][1]})"
        if msg.model not in self.waiting:
            return (f"the group has no model {msg.model!r} waiting to join; it waits for: "
                    f"{', '.join(self.waiting) or 'none'}")
        if msg.identity.vocab_hash != self.vocab_hash:
            return ("its tokenizer's vocabulary differs from the entry model's; token ids pass between the models, "
                    "so they must share one tokenizer")
        path = self.group.spec(msg.model).engine.model_path
        if (Path(path) / "config.json").is_file():  # the entry may not hold the model's folder
            diffs = ModelIdentity.from_folder(path).differences(msg.identity)
            if diffs:
                return (f"it serves another model than the config names for {msg.model!r} ({path}): "
                        f"{'; '.join(diffs)} (config != joiner)")
        return None

    def handle(self, msg: Join) -> None:
        reason = self.check(msg)
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        secure_client(sock, self.keys)
        sock.connect(msg.address)
        if reason is None:
            group = self.group.to_dict()
            group["secret"] = None  # the joiner has its own copy; never send it
            sock.send(encode(Welcome(group)))
            self.waiting.remove(msg.model)
            self.joined[msg.model] = (time.monotonic(), msg.address)
            logger.info("model %r joined from %s (inbox %s)", msg.model, msg.host, msg.address)
        else:
            sock.send(encode(Refused(reason)))
            logger.warning("refused a subserver from %s for model %r: %s", msg.host, msg.model, reason)
        sock.close()


class JoinedSubserver:
    """A joined subserver, alive while the entry's connection to its inbox is."""

    def __init__(self, name: str, address: str, watch: ConnectionWatch) -> None:
        self.name, self.address, self.watch = name, address, watch

    def failure(self) -> str | None:
        if self.watch.gone():
            return f"the connection to subserver {self.name!r} (joined, inbox {self.address}) dropped"
        return None

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.watch.gone():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def kill(self) -> None:
        """Another host's process: nothing to kill from here. It exits when our connection drops."""

    def close(self) -> None:
        self.watch.close()
