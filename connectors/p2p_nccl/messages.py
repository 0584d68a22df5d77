"""Control messages of the P2P KV connector, encoded with ``engine_core.codec``.

Flow per request (one control round trip, then data):
  D -> P ``KVPullRequest``   D allocated blocks: the blocks it lacks, its cache geometry,
                             its epoch (a new one at a known address: D restarted).
  P -> D ``KVSendHeader``    P is about to send: validated by D before it posts receives.
  P -> D ``KVLayerData``     CPU transport only: one message (plus a bytes frame) per data call.

The data of a transfer moves in calls of ``layers_per_call`` consecutive layers (the last
call may hold fewer), chosen by P within the pull's ``max_layers_per_call`` (D's receive
slot, when the transfer streams through D's buffer; D refuses a header above it) and
announced in the header, so both sides post matching operations without any per-call
control message. A call's bytes are its layers' blocks in
the layout of ``block_copy`` (``[layers, 2, blocks, block_size, heads, head_dim]``).
  P -> D ``KVSendAbort``     P cannot send (bad geometry, allocation failure, deadline).
  P -> D ``NcclHello``       NCCL transport only: the unique id of a new pair communicator.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_core.addresses import is_host_port
from engine_core.cluster.grants import MAX_GRANT_CHARS
from engine_core.cluster.sealed_codec import SealedCodec
from engine_core.cluster.trust import CHANNEL_KV_CONTROL, ClusterSecret
from engine_core.codec import MessageCodec

# Cache dtypes the wire may carry (names as in torch, without the ``torch.`` prefix).
WIRE_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "uint8")
MAX_LAYERS = 1024
MAX_BLOCKS = 1 << 20
MAX_EPOCH_CHARS = 64
MAX_TIMEOUT_S = 86400.0
# A transfer id is kept (registrations, tombstones) and logged: bounded like a request id
# (the server's X-Request-Id limit is 256) with room for "-pN" and "-retryN" suffixes.
MAX_TRANSFER_ID_CHARS = 1024


@dataclass
class KVPullRequest:
    """D asks P for blocks ``[first_block, first_block + num_blocks)`` of a transfer.

    ``num_blocks == 0`` means D needs nothing (its prefix cache holds the whole prompt):
    P releases whatever it keeps for the transfer. Sent after a pull (the request was aborted
    on D), it cancels that pull: P answers with ``KVSendAbort`` when it dropped the pull
    before any send (D may then reuse the receive bytes), and ignores it when the send has
    started (its header answers).
    """

    transfer_id: str
    consumer_address: str
    first_block: int
    num_blocks: int
    num_layers: int
    dtype: str
    block_shape: list[int]  # [block_size, num_kv_heads, head_dim]
    # How long the consumer still waits for this transfer (from when it sends the pull): the
    # producer's send must end by then.
    timeout_s: float
    # The consumer process's incarnation (random per start). A producer that sees a new one
    # for a known address knows the process behind it restarted: its pair with the address
    # and the sends asked for by the old process are stale. Empty: not said (tools).
    consumer_epoch: str = ""
    # The most layers one data call may carry (0: no limit). A load larger than D's receive
    # buffer streams through slots of whole layers; P sizes its calls to fit one, instead of
    # having a larger call's header refused and its pair aborted.
    max_layers_per_call: int = 0
    # The proxy's transfer grant (``engine_core.cluster.grants``) that D's scheduler side
    # checked: P serves the pull, a release included, only when it names this P and
    # ``consumer_address`` as D and covers ``transfer_id``. Empty: none (refused).
    grant: str = ""


@dataclass
class KVSendHeader:
    """P announces a transfer; D checks it against its pull request before receiving."""

    transfer_id: str
    producer_address: str
    producer_epoch: str
    seq: int
    first_block: int
    num_blocks: int
    num_layers: int
    dtype: str
    block_shape: list[int]
    layers_per_call: int


@dataclass
class KVLayerData:
    """One data call over the CPU transport (layers from ``layer``); the bytes follow as a frame."""

    transfer_id: str
    producer_epoch: str
    seq: int
    layer: int
    nbytes: int


@dataclass
class KVSendAbort:
    """P gives up on a transfer; D fails it at once instead of waiting for its deadline."""

    transfer_id: str
    producer_address: str
    reason: str


@dataclass
class NcclHello:
    """P opens (or rebuilds) the 2-rank NCCL communicator of a (P, D) pair; P is rank 0."""

    producer_address: str
    producer_epoch: str
    unique_id: bytes


CONTROL_MESSAGES = (KVPullRequest, KVSendHeader, KVLayerData, KVSendAbort, NcclHello)


# Version of the connector's control messages AND of the data layout they announce
# (2: kv-major ``[layers, 2, blocks, ...]`` call buffers; 3: the pull's
# ``max_layers_per_call``; 4: the pull's ``grant``); a peer of another version is rejected at its first message
# instead of receiving bytes it would misread or calls it cannot hold.
WIRE_VERSION = 4


# A control message is a few hundred bytes (a transfer id of at most 1,024 characters and a
# grant of at most 4,096 are the largest fields); the bound is what a receiver reads before refusing one.
MAX_CONTROL_BYTES = 64 << 10
CONTROL_CODEC = MessageCodec(CONTROL_MESSAGES, version=WIRE_VERSION, max_bytes=MAX_CONTROL_BYTES)


def make_codec(secret: ClusterSecret = ClusterSecret(), sender_id: str = "kv") -> SealedCodec:
    """The codec every control socket of the connector uses: control messages in the
    cluster's authenticated envelope (``engine_core.cluster.trust``), sealed as ``sender_id``.
    The CPU transport's data frames follow a sealed ``KVLayerData`` that names their size."""
    return SealedCodec(CONTROL_CODEC, secret, CHANNEL_KV_CONTROL, sender_id)


def layer_nbytes(num_blocks: int, block_shape: list[int], element_size: int) -> int:
    """Bytes of one layer's K and V for ``num_blocks`` blocks."""
    size = 2 * num_blocks * element_size
    for dim in block_shape:
        size *= dim
    return size


def plan_layers_per_call(num_layers: int, layer_bytes: int, min_call_bytes: int,
                         max_layers: int = 0) -> int:
    """Layers per data call so that each call carries about ``min_call_bytes`` or more.

    Why: a point-to-point call costs ~15 us of latency whatever its size, so a small request
    sent layer by layer is latency-bound (36 calls of 0.5 MB reach a fraction of the link).
    Grouping consecutive layers keeps large prompts layer-wise (a layer over the threshold is
    its own call, overlapping the next layer's compute) and sends small ones in one call.
    ``min_call_bytes <= 0`` sends every layer alone. ``max_layers > 0`` caps a call at that
    many layers: the consumer's receive slot (the pull's ``max_layers_per_call``).
    """
    if min_call_bytes <= 0 or num_layers <= 1:
        return 1
    num_calls = max(1, min(num_layers, (num_layers * layer_bytes) // min_call_bytes))
    planned = -(-num_layers // num_calls)
    return min(planned, max_layers) if max_layers > 0 else planned


def call_ranges(num_layers: int, layers_per_call: int) -> list[tuple[int, int]]:
    """``[(first_layer, end_layer), ...]`` of the data calls of one transfer."""
    return [(lo, min(lo + layers_per_call, num_layers)) for lo in range(0, num_layers, layers_per_call)]


def check_geometry(num_layers: int, num_blocks: int, dtype: str, block_shape: list[int]) -> str | None:
    """Why these fields cannot describe a transfer, or None when they can."""
    if not 0 < num_layers <= MAX_LAYERS:
        return f"num_layers {num_layers} out of range"
    if not 0 <= num_blocks <= MAX_BLOCKS:
        return f"num_blocks {num_blocks} out of range"
    if dtype not in WIRE_DTYPES:
        return f"dtype {dtype!r} not supported"
    if len(block_shape) != 3 or any(d < 1 or d > 65536 for d in block_shape):
        return f"block_shape {block_shape} invalid"
    return None


def check_pull(pull: KVPullRequest, num_layers: int, dtype: str, block_shape: list[int]) -> str | None:
    """Validate a pull request against this producer's cache geometry. A pull may ask for
    fewer KV heads than a block holds (one route between tensor-parallel layouts); that they
    are the heads its transfer moves is checked when it meets its save. A release
    (``num_blocks == 0``) moves nothing: its geometry is not read (the proxy's carries none,
    ``release_request``)."""
    if pull.num_blocks != 0:
        reason = check_geometry(pull.num_layers, pull.num_blocks, pull.dtype, pull.block_shape)
        if reason:
            return reason
        if pull.first_block < 0:
            return "negative first_block"
        block_size, num_heads, head_dim = block_shape
        asked_size, asked_heads, asked_dim = pull.block_shape
        if ((pull.num_layers, pull.dtype, asked_size, asked_dim)
                != (num_layers, dtype, block_size, head_dim) or asked_heads > num_heads):
            return (f"geometry mismatch: peer has {pull.num_layers} layers {pull.dtype} "
                    f"{pull.block_shape}, we have {num_layers} {dtype} {block_shape}")
    if not 0 < len(pull.transfer_id) <= MAX_TRANSFER_ID_CHARS:
        return f"transfer id of {len(pull.transfer_id)} characters"
    if not is_host_port(pull.consumer_address):
        return "bad consumer address"
    if not is_epoch(pull.consumer_epoch):
        return "bad consumer epoch"
    if not 0.0 <= pull.timeout_s <= MAX_TIMEOUT_S:  # also false for NaN
        return f"timeout_s {pull.timeout_s} out of range"
    if not 0 <= pull.max_layers_per_call <= MAX_LAYERS:
        return f"max_layers_per_call {pull.max_layers_per_call} out of range"
    if len(pull.grant) > MAX_GRANT_CHARS:
        return f"grant of {len(pull.grant)} characters"
    return None


def release_request(transfer_id: str, consumer_address: str, grant: str) -> KVPullRequest:
    """A release of ``transfer_id`` on behalf of the consumer at ``consumer_address`` (the
    address its grant names), from a sender that holds no cache: the proxy, once that
    consumer will never pull (it refused the request, or failed). No geometry: a producer
    reads none for a release."""
    return KVPullRequest(transfer_id=transfer_id, consumer_address=consumer_address,
                         first_block=0, num_blocks=0, num_layers=0, dtype="", block_shape=[],
                         timeout_s=0.0, grant=grant)


def check_header(header: KVSendHeader, pull: KVPullRequest, last_seq: int | None) -> str | None:
    """Validate a send header against the pull request it answers, before posting receives."""
    reason = check_geometry(header.num_layers, header.num_blocks, header.dtype, header.block_shape)
    if reason:
        return reason
    if header.transfer_id != pull.transfer_id:
        return "transfer id mismatch"
    if not 1 <= header.layers_per_call <= header.num_layers:
        return f"layers_per_call {header.layers_per_call} out of range"
    if 0 < pull.max_layers_per_call < header.layers_per_call:
        return (f"layers_per_call {header.layers_per_call} above the requested "
                f"{pull.max_layers_per_call}")
    if last_seq is not None and header.seq <= last_seq:
        return f"sequence number {header.seq} not after {last_seq}"
    expected = (pull.first_block, pull.num_blocks, pull.num_layers, pull.dtype, list(pull.block_shape))
    got = (header.first_block, header.num_blocks, header.num_layers, header.dtype,
           list(header.block_shape))
    if got != expected:
        return f"header {got} does not match request {expected}"
    return None


_EPOCH_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


NCCL_UNIQUE_ID_BYTES = 128  # ncclUniqueId: what cupy's get_unique_id gives, as bytes


def check_hello(hello: NcclHello) -> str | None:
    """Why an NcclHello is malformed, or None. Each accepted hello replaces the pair with its
    address and starts a communicator join, so the fields are checked first."""
    if not is_host_port(hello.producer_address):
        return "bad producer address"
    if not is_epoch(hello.producer_epoch) or not hello.producer_epoch:
        return "bad producer epoch"
    if len(hello.unique_id) != NCCL_UNIQUE_ID_BYTES:
        return f"unique id of {len(hello.unique_id)} bytes, not {NCCL_UNIQUE_ID_BYTES}"
    return None


def is_epoch(epoch: object) -> bool:
    """Whether ``epoch`` can name a process incarnation: up to 64 letters, digits, ``-`` or
    ``_`` (empty: none said). It is kept per peer and logged, so nothing else is accepted."""
    return isinstance(epoch, str) and len(epoch) <= MAX_EPOCH_CHARS and set(epoch) <= _EPOCH_CHARS
