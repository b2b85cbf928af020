"""Wire formats: the ZMQ messages between ranks (kv_transfer_params: `kv_params`).

ZMQ frames carry msgspec msgpack structs, tagged so one decoder reads them all.
A frame that does not decode is reported as `ProtocolError` and dropped by the
caller; it is never fatal.
"""

from __future__ import annotations

import enum

import msgspec

# ---------------------------------------------------------------- ZMQ messages

#: Version of the ZMQ wire (frame envelope, transfer.frames, and these messages). 2: frames carry
#: sender, session, sequence and receiver under a MAC keyed with a key derived from the token
#: . A PeerHello names it; P refuses a decode peer of another version, naming both.
WIRE_VERSION = 2


class PeerHello(msgspec.Struct, tag="hello", frozen=True):
    """D rank -> P rank, once per peer: where to write and how D's KV is laid out."""

    peer_id: str
    transfer_descriptor: bytes  # opaque: where the transfer backend writes to reach this rank
    endpoint: str  # D's ZMQ PULL endpoint for replies, "tcp://ip:port"
    tp_rank: int
    tp_size: int
    block_size: int
    kv_dtype: str
    num_layers: int
    # One region per (layer, K/V part): [base_addr, block_stride_bytes, block_bytes]
    regions: list[tuple[int, int, int]]
    total_kv_heads: int = 1  # the model's KV heads (1 for MLA)
    local_kv_heads: int = 1  # KV heads in this rank's blocks
    use_mla: bool = False
    heads_outermost: bool = True  # a run of heads is one byte range per block
    token_major: bool = False  # [blocks, block_size, heads, dim] with a staging buffer (nhd_reshuffle)
    num_blocks: int = 0  # blocks of each region (P writes only inside them, transfer.write_guard); 0: not told
    region_groups: list[int] = []  # KV cache group of each region (kv_groups); empty: all group 0
    # Global layer index of each region (layouts.pp): a pipeline-parallel P stage takes its layers' regions.
    region_layers: list[int] = []
    wire_version: int = 0  # WIRE_VERSION of the sender (0: a peer from before version 2)


class TransferRequest(msgspec.Struct, tag="xfer", frozen=True):
    """D rank -> P rank: write room's KV from P block index `start_block` on into dst_block_ids.

    An empty dst_block_ids means D needs nothing (full local prefix hit): P frees the room.
    """

    room: int
    request_id: str
    peer_id: str
    dst_block_ids: list[int]
    start_block: int
    endpoint: str = ""  # D's ZMQ endpoint, so P can answer even a peer it does not know
    want_checksum: bool = False  # D verifies what lands (verify_kv): P sends a checksum of what it wrote
    # Hybrid KV cache manager: every KV cache group's blocks (null block 0: not needed); empty: one group.
    dst_groups: list[list[int]] = []


class DoneStatus(enum.IntEnum):
    """Outcome of one TransferRequest, as P reports it in TransferDone.status."""

    OK = 0
    UNKNOWN_PEER = 1  # P has no PeerHello from this D rank (P restarted): D must introduce itself again
    INCOMPATIBLE = 2  # D's KV layout or model does not fit P's
    ROOM_CLOSED = 3  # the room was closed (sent, expired, cancelled) and no new prefill came
    ALREADY_SERVED = 4  # P already took every request it expected for the room
    TIMEOUT = 5  # P did not produce the room within room_timeout_s
    TRANSFER_FAILED = 6  # the backend write failed
    ABORTED = 7  # the prefill request was aborted before its KV was ready
    BAD_REQUEST = 8  # the request does not fit the room (more blocks than P holds)
    INTERNAL_ERROR = 9
    CANCELLED = 10  # D cancelled this request (answer to its TransferCancel; no write happened)
    PEER_LOST = 11  # P heard nothing from this D rank for peer_timeout_s and dropped its requests


class TransferDone(msgspec.Struct, tag="done", frozen=True):
    """P rank -> D rank: the KV of `room` is in place (OK) or will never be (error names why)."""

    room: int
    request_id: str
    tp_rank: int
    status: DoneStatus
    error: str = ""  # for logs; D decides on ``status``
    nbytes: int = -1  # OK: bytes this P rank wrote for the request (-1: not told; D refuses that)
    checksum: int | None = None  # OK, asked for (want_checksum): transfer.checksum of the bytes written
    pp_rank: int = 0  # the P rank's pipeline stage (layouts.pp): D waits for every stage it asked

    @property
    def ok(self) -> bool:
        return self.status is DoneStatus.OK


class TransferCancel(msgspec.Struct, tag="cancel", frozen=True):
    """D rank -> P rank: D gave up on room (timeout); do not write into its blocks.

    With ``release`` (P's bootstrap server -> every P rank: ``POST /bootstrap/release_room``, the
    client's request ended) the whole room goes, whatever claims it has: the reason, told to every D
    that asks for the room afterwards (``request_id`` and ``peer_id`` are then empty)."""

    room: int
    request_id: str
    peer_id: str = ""  # the D rank that gave up: P counts claims per (request, D rank)
    release: str = ""


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Liveness (transfer.liveness): a rank with pending work toward the rank at ``about`` asks it to answer."""

    about: str  # the receiver's endpoint as the sender knows it (echoed in the Pong)
    reply_to: str  # the sender's PULL endpoint


class Pong(msgspec.Struct, tag="pong", frozen=True):
    """Liveness: the answer to a Ping; ``about`` is the Ping's, so the pinger knows who answered."""

    about: str


Message = PeerHello | TransferRequest | TransferDone | TransferCancel | Ping | Pong

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class ProtocolError(ValueError):
    """A ZMQ frame that is not a PDConnector message."""


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes) -> Message:
    try:
        return _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable frame ({len(frame)} bytes): {exc}") from None


# ------------------------------------------------------------ bootstrap schemas


class RankInfo(msgspec.Struct, frozen=True):
    rank_ip: str
    rank_port: int
    #: What bounds this rank's writes (``RegisterRank``'s, passed on): D's wait for a stopped load.
    batch_stall_s: float = 0.0
    peer_timeout_s: float = 0.0


class RegisterRank(msgspec.Struct, frozen=True):
    """Body of PUT /bootstrap/register_rank."""

    attn_tp_size: int
    attn_tp_rank: int
    attn_dp_size: int
    attn_dp_rank: int
    rank_ip: str
    rank_port: int
    block_size: int
    kv_cache_dtype: str
    attn_cp_size: int = 1
    attn_cp_rank: int = 0
    num_layers: int = 0
    #: What the rank serves, in the terms that decide whether KV fits (see compat.model_fingerprint).
    model: str = ""
    #: Pipeline parallelism (layouts.pp): the rank's stage and its layers [first_layer, end_layer).
    pp_size: int = 1
    pp_rank: int = 0
    first_layer: int = 0
    end_layer: int = 0  # 0: not told (PP 1)
    #: What bounds this rank's writes to D (transfer.loads.PeerTiming): its transport's longest batch
    #: write (``BackendOptions.batch_stall_s``) and its ``peer_timeout_s``. D holds a stopped load's
    #: blocks by these, not by its own settings. 0: not told (a rank from an older release: D uses its own).
    batch_stall_s: float = 0.0
    peer_timeout_s: float = 0.0


class Route(msgspec.Struct, frozen=True):
    """Body of GET /bootstrap/route: the prefill deployment's topology."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    block_size: int
    kv_cache_dtype: str
    num_layers: int
    is_ready: bool
    # key "dp,cp,tp" (stage 0), "dp,cp,tp,pp" (later pipeline stages)
    ranks: dict[str, RankInfo]
    model: str = ""
    pp_size: int = 1
    #: [first_layer, end_layer) of each pipeline stage, by pp rank (empty with PP 1)
    stage_layers: list[tuple[int, int]] = []

    def rank(self, dp: int, cp: int, tp: int, pp: int = 0) -> RankInfo | None:
        return self.ranks.get(rank_key(dp, cp, tp, pp))


def rank_key(dp: int, cp: int, tp: int, pp: int = 0) -> str:
    """A rank's key in ``Route.ranks``; stage 0's is the one readers without pipeline stages know."""
    return f"{dp},{cp},{tp}" if pp == 0 else f"{dp},{cp},{tp},{pp}"
