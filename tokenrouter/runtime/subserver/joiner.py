"""`tokenrouter subserver --join ADDRESS`: a subserver started by hand on another host.

It proves it holds the group's secret (the CURVE handshake with the entry's inbox), says which model it
serves (name, shape, vocabulary hash of its local folder), and gets back either the group config or the
reason it was refused. Then it loads the model and serves like a spawned subserver, until the entry
sends Shutdown or the connection to the entry drops: it serves one entry, once (run it under a
supervisor that restarts it to rejoin a restarted entry).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import zmq

from tokenrouter.runtime.connection_watch import ConnectionWatch, HandshakeFailed
from tokenrouter.runtime.group_config import LOOPBACK, GroupConfig, ModelSpec
from tokenrouter.runtime.messages import Join, Refused, Welcome, decode, encode
from tokenrouter.runtime.model_identity import ModelIdentity
from tokenrouter.runtime.transport_security import keys_from_secret, secure_client, secure_server, start_authenticator

logger = logging.getLogger(__name__)

_WILDCARDS = ("0.0.0.0", "::", "*")


class JoinRefused(RuntimeError):
    """The entry answered, and said no."""


def entry_endpoint(address: str) -> tuple[str, str]:
    """('tcp://HOST:PORT', HOST) from 'HOST:PORT' or 'tcp://HOST:PORT'."""
    bare = address.removeprefix("tcp://")
    host, sep, port = bare.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--join takes the entry's HOST:PORT (its entry_host and entry_port), got {address!r}")
    return f"tcp://{bare}", host


def route_address(host: str) -> str:
    """This machine's address on the route to `host` (a UDP connect sends nothing)."""
    if host in LOOPBACK:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


def read_secret(secret_file: str | None) -> str | None:
    if secret_file:
        secret = Path(secret_file).read_text().strip()
        if not secret:
            raise ValueError(f"the secret file {secret_file} is empty")
        return secret
    return os.environ.get("TOKENROUTER_SECRET") or None


def ask_to_join(entry: str, name: str, model_path: str, secret: str | None, bind_host: str, port: int,
                advertise: str, timeout: float) -> tuple[dict[str, Any], int]:
    """Handshake, Join, answer: the group config as a dict and the inbox port used. Raises
    HandshakeFailed or JoinRefused with the reason."""
    identity = ModelIdentity.from_folder(model_path)  # before any socket: a bad folder fails here
    keys = keys_from_secret(secret) if secret else None
    ctx = zmq.Context()
    auth = start_authenticator(ctx, keys) if keys else None
    inbox = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    watch = ConnectionWatch(push)
    try:
        secure_server(inbox, keys)
        inbox.bind(f"tcp://{bind_host}:{port or '*'}")
        port = int(inbox.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        secure_client(push, keys)
        push.connect(entry)
        watch.wait_handshake(timeout, f"the entry at {entry}")
        push.send(encode(Join(name, f"tcp://{advertise}:{port}", identity, socket.gethostname())))
        if not inbox.poll(int(timeout * 1000)):
            raise HandshakeFailed(f"the entry at {entry} did not answer within {timeout:.0f} s: it may not wait for "
                                  f"a joiner (no model marked start: join), or it cannot reach tcp://{advertise}:{port}")
        reply = decode(inbox.recv())
    finally:
        watch.close()
        push.close(linger=0)
        inbox.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.term()
    if isinstance(reply, Refused):
        raise JoinRefused(f"the entry refused model {name!r}: {reply.reason}")
    if not isinstance(reply, Welcome):
        raise JoinRefused(f"the entry answered with {type(reply).__name__}, not Welcome")
    return reply.group, port


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # reported to the entry like any failure


def cmd_subserver(args: argparse.Namespace) -> int:
    from tokenrouter.runtime.subserver.process import configure_process, serve_subserver

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    entry, entry_host = entry_endpoint(args.join)
    secret = read_secret(args.secret_file)
    if secret is None:  # the tcp transport always has one, loopback included
        raise ValueError("joining needs the group's secret: --secret-file or $TOKENROUTER_SECRET")
    bind_host = args.host or route_address(entry_host)
    advertise = args.advertise or bind_host
    if advertise in _WILDCARDS:
        raise ValueError(f"--host {bind_host} is every interface: give --advertise, the address peers reach it at")
    try:
        group_dict, port = ask_to_join(entry, args.name, args.model_path, secret, bind_host, args.port, advertise,
                                       args.join_timeout)
    except (HandshakeFailed, JoinRefused) as e:
        print(f"tokenrouter subserver: error: {e}", file=sys.stderr)
        return 2
    # This host's own placement: the model folder here, and optionally its device, threads and cores.
    for m in group_dict["models"]:
        if m["name"] == args.name:
            m["path"] = args.model_path
            m.update({k: v for k, v in (("device", args.device), ("threads", args.threads),
                                        ("cores", args.cores)) if v is not None})
    group_dict["secret"] = secret
    group = GroupConfig.from_dict(group_dict)
    spec: ModelSpec = group.spec(args.name)
    configure_process(spec)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    logger.info("joined %s as %r; loading %s", entry, args.name, args.model_path)
    try:
        serve_subserver(spec, group, f"tcp://{bind_host}:{port}", entry,
                        advertise_host=advertise if advertise != bind_host else None, watch_entry=True)
    except (KeyboardInterrupt, SystemExit) as e:
        logger.info("%s: stopped (%s)", args.name, e or type(e).__name__)
        return 1
    logger.info("%s: the entry ended the session", args.name)
    return 0


def add_subserver_parser(sub: Any) -> None:
    p = sub.add_parser("subserver", help="serve one model of a group from this host: join an entry started by "
                                         "`tokenrouter serve` whose config marks the model start: join")
    p.add_argument("--join", required=True, metavar="HOST:PORT", help="the entry's address (entry_host:entry_port)")
    p.add_argument("--name", required=True, help="the model's name in the group config")
    p.add_argument("--model-path", "--model", dest="model_path", required=True, help="the model folder on this host")
    p.add_argument("--host", default=None,
                   help="interface for this subserver's inbox (default: this host's address towards the entry)")
    p.add_argument("--port", type=int, default=0, help="inbox port (default: any free port)")
    p.add_argument("--advertise", default=None, help="address the entry and peers reach the inbox at (default: --host)")
    p.add_argument("--secret-file", default=None, help="file holding the group's secret (default: $TOKENROUTER_SECRET)")
    p.add_argument("--device", default=None, help="override the config's device for this host")
    p.add_argument("--threads", type=int, default=None, help="override the config's torch threads")
    p.add_argument("--cores", type=lambda s: [int(c) for c in s.split(",")], default=None,
                   help="pin to these cores, e.g. 0,1")
    p.add_argument("--join-timeout", type=float, default=300.0,
                   help="seconds to wait for the entry's handshake and for its answer")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_subserver)
