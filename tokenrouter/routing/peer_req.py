"""The message a model sends a peer when it hands a request over."""

from __future__ import annotations

import msgspec

from tokenrouter.engine.req import LooseVerify


class PeerReq(msgspec.Struct, kw_only=True):
    """A hand-off, built by `RoutingAlgorithm.send`.

    The receiver truncates its copy of request `rid` to `loc` (the absolute position, in prompt +
    output, where `suffix` starts), appends `suffix`, and runs it. `finished` tells a peer that the
    request is over so it frees its KV. `draft`: the suffix's last `draft` tokens are proposals for
    the receiver to verify (the runtime sets it from the sender's Route.draft tokens), exactly or by
    the rule `loose` (Req.loose).
    """

    rid: str
    suffix: list[int]
    loc: int
    finished: bool = False
    draft: int = 0
    loose: LooseVerify | None = None
