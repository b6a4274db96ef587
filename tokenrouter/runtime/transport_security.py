"""Authenticated, encrypted ZeroMQ sockets for subservers on other hosts (tcp transport).

Every process of a group knows a shared secret. From it each derives the same two CURVE keypairs:
one for every socket that binds (the inboxes), one for every socket that connects. A connecting peer
must prove it holds the client key (checked on connect by a ZAP handler that accepts that key alone),
and it can only reach the inbox by knowing the server's public key: both come from the secret, so a
process without it is refused at the handshake, before any message is read.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import NamedTuple

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85


class CurveKeys(NamedTuple):
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def keys_from_secret(secret: str) -> CurveKeys:
    if len(secret) < 16:
        raise ValueError("the shared secret must be at least 16 characters")

    def pair(role: str) -> tuple[bytes, bytes]:
        sk = z85.encode(hashlib.sha256(f"tokenrouter/{role}/{secret}".encode()).digest())
        return zmq.curve_public(sk), sk

    sp, ss = pair("server")
    cp, cs = pair("client")
    return CurveKeys(sp, ss, cp, cs)


class _OnlyOurClients:
    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.key)  # constant time: no timing hint about the key


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """Run the ZAP handler for this context's bound sockets (stop it before the context terms)."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_OnlyOurClients(keys.client_public))
    return auth


def secure_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Call before bind()."""
    if keys is not None:
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Call before connect()."""
    if keys is not None:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
