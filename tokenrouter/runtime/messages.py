"""Messages between the entry and the subservers, and between subservers (msgpack, never pickle)."""

from __future__ import annotations

import logging
from typing import Any, Union

import msgspec
import zmq

from tokenrouter.routing.peer_req import PeerReq
from tokenrouter.runtime.model_identity import ModelIdentity
from tokenrouter.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AddReq(msgspec.Struct, tag="add"):
    """Entry -> entry model: a new request. Its stop strings stay at the entry, which detects them."""

    rid: str
    tokens: list[int]
    params: SamplingParams
    seed: int
    # This request's routing parameters, resolved once at the entry (the group's defaults with the
    # request's overrides, RoutingAlgorithm.resolve_request); empty: the group's defaults.
    routing: dict[str, Any] = {}
    trace: bool = False  # the request asked for a per-token trace (Trace on each of its tokens)
    alone: bool = False  # one model writes it all (routing.model): no routing decision is taken


class Abort(msgspec.Struct, tag="abort"):
    """Entry -> every subserver: drop the request wherever it is (running, waiting or PENDING)."""

    rid: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class StatsQuery(msgspec.Struct, tag="stats?"):
    pass


class Active(msgspec.Struct, tag="active"):
    """Entry -> every subserver: the group now has n live (admitted, unfinished) requests."""

    n: int


class SetThresholds(msgspec.Struct, tag="thresholds"):
    """Entry -> a subserver: launch when B(n) requests are ready (delayed batching), table {n: B}."""

    table: dict[int, int]


class Wake(msgspec.Struct, tag="wake"):
    """To the entry's own inbox from another thread of its process: stop waiting, work arrived."""


class Topology(msgspec.Struct, tag="topology"):
    """Entry -> every subserver, once all are ready: where each model's inbox listens."""

    addresses: dict[str, str]


class FirstVisit(msgspec.Struct):
    """What a model needs to create a request it has never seen."""

    prompt_len: int
    params: SamplingParams
    seed: int
    routing: dict[str, Any] = {}  # as AddReq.routing
    trace: bool = False  # as AddReq.trace


class Trace(msgspec.Struct, array_like=True, omit_defaults=True):
    """A traced request's attribution of one token (on its TokenEvent), or, travelling with a hand-off,
    what the peer's next token will carry.

    path: the models the request passed through since its previous token, ending with the writer
      ([] : no hand-off before this token; [small, large]: one, small to large; [large, small, large]:
      two).
    score, threshold: the router's score at this token's position and the threshold it was compared
      with (None: the algorithm has none). At a position one model handed away without keeping its
      token, the score is the one that handed it away.
    rejected: the drafts the writer verified and rejected here (speculative decoding): the run this
      token replaces."""

    path: list[str] = []
    score: float | None = None
    threshold: float | None = None
    rejected: list[int] = []


class Handoff(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's hand-off (or its finish notice, when req.finished)."""

    req: PeerReq
    first: FirstVisit | None = None
    handoffs: int = 0  # the request's hand-offs so far, this one included (travels with the request)
    trace: Trace | None = None  # traced requests only: for the peer's next token


class Peer(msgspec.Struct, tag="peer"):
    """Subserver -> subserver: one step's hand-offs and finish notices for this peer, in order."""

    sender: str
    items: list[Handoff]


class TokenEvent(msgspec.Struct, array_like=True, omit_defaults=True):
    rid: str
    pos: int  # absolute position in prompt + output
    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    trace: Trace | None = None  # traced requests only


class Tokens(msgspec.Struct, tag="tokens"):
    """Subserver -> entry: tokens committed in one step, each with its absolute position."""

    model: str
    items: list[TokenEvent]
    # rid -> that request's hand-offs so far, for the requests this step handed to a peer
    handoffs: dict[str, int] = {}
    answered: bool = False  # written from a look-ahead row, with no step (engine.py Engine.receive)


class PromptLogprobs(msgspec.Struct, tag="prompt_logprobs"):
    """subserver -> entry: a request's prompt logprobs (SamplingParams.prompt_logprobs), sent by the
    model that prefilled it, before its first token: one entry per prompt token from the second on."""

    rid: str
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]


class Finished(msgspec.Struct, tag="finished"):
    """Subserver -> entry: the request ended on `model` with `length` tokens (prompt + output)."""

    rid: str
    model: str
    reason: str
    stop_reason: int | None
    length: int
    handoffs: int = 0  # hand-offs (PeerReqs sent, every model counted) the request made


class Ready(msgspec.Struct, tag="ready"):
    model: str
    address: str  # where the subserver's inbox listens
    pid: int
    capacity_tokens: int
    page_size: int
    max_model_len: int
    vocab_size: int
    latency: dict[str, Any] | None = None  # StepLatency measured at start-up, when the planner asked for it
    vocab_hash: str = ""  # model_identity.vocab_hash of its tokenizer
    torch_threads: int = 0  # torch.get_num_threads() in the serving process (0: not reported)
    cpu_affinity: list[int] = []  # the cores the process may run on (os.sched_getaffinity), sorted


class Join(msgspec.Struct, tag="join"):
    """A subserver started by hand on another host -> the entry: I serve `model`, my inbox is `address`."""

    model: str
    address: str
    identity: ModelIdentity
    host: str  # for the entry's log: who joined


class Welcome(msgspec.Struct, tag="welcome"):
    """Entry -> joiner: accepted; the group config (its model's spec included) to load and serve."""

    group: dict[str, Any]


class Refused(msgspec.Struct, tag="refused"):
    """Entry -> joiner: not accepted, and why."""

    reason: str


class ReqError(msgspec.Struct, tag="error"):
    """Subserver -> entry: a request failed on `model` (rid None: the subserver itself failed)."""

    model: str
    rid: str | None
    message: str


# Upper bounds (seconds) of the step-latency histogram each subserver keeps; the last bucket is +Inf.
STEP_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Stats(msgspec.Struct, tag="stats"):
    model: str
    steps: int
    tokens_written: int
    extended_tokens: int
    handoffs_sent: int
    pending_periods: int
    pending_seconds: float
    preemptions: int
    free_pages: int
    cached_pages: int
    total_pages: int
    live_requests: int
    waiting_requests: int
    step_seconds_sum: float
    step_buckets: list[int]  # steps per STEP_LATENCY_BUCKETS bound, then the +Inf overflow (not cumulative)
    aborted_requests: int = 0  # live requests this model dropped on an Abort
    look_aheads: int = 0  # rows run ahead for requests at a peer (engine.py Engine.hand_off)
    look_ahead_hits: int = 0  # of those, the ones answered from when the request came back
    drafts_verified: int = 0  # peers' drafts this model verified (engine.py Engine.accept_drafts)
    drafts_accepted: int = 0  # of those, the ones it kept
    threaded_steps: int = 0  # steps run on more than one thread (engine/step_board.py CoreShare)
    request_errors: dict[str, int] = msgspec.field(default_factory=dict)  # requests failed alone, by stage


Message = Union[AddReq, Abort, Active, SetThresholds, Shutdown, StatsQuery, Topology, Wake, Peer, Tokens, Finished,
                PromptLogprobs, Ready, ReqError, Stats, Join, Welcome, Refused]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)


def receive_waiting(sock: zmq.Socket, who: str) -> list[Message]:
    """Every message waiting on `sock`, decoded, without blocking. One that does not decode is logged
    and dropped: a stray or corrupt message must not stop `who` (the entry, or a model)."""
    out: list[Message] = []
    while True:
        try:
            data = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return out
        try:
            out.append(decode(data))
        except msgspec.DecodeError as e:
            logger.warning("%s: dropped an undecodable message (%d bytes): %s", who, len(data), e)
