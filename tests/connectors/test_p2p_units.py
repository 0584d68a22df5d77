"""Unit tests: control messages, receive-buffer accounting, block copy, control channel,
scheduler-side decisions."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from connectors import create_connector
from connectors.p2p_nccl.handshake import ControlClient, ControlServer
from connectors.p2p_nccl.messages import (
    CONTROL_CODEC,
    KVPullRequest,
    KVSendHeader,
    call_ranges,
    check_header,
    check_pull,
    make_codec,
    plan_layers_per_call,
)
from connectors.p2p_nccl.recv_buffer import RecvBuffer
from connectors.p2p_nccl.scheduler_side import P2pConnectorScheduler
from engine_core.cluster.trust import ClusterSecret, TrustRefusal
from engine_core.config import EngineConfig, KVTransferConfig, ModelConfig
from engine_core.errors import KVTransferError, MessageDecodeError
from engine_core.kv_connector import FinishedTransfers, NullConnectorScheduler
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core.worker.block_copy import (
    block_ids_tensor,
    gather_layers,
    scatter_layers,
    stack_layers,
    wire_shape,
)
from engine_core.worker.kv_cache import KVCacheShape, allocate_kv_caches
from tests.connectors.kv_harness import free_port
from tests.kv_grants import granted_params, transfer_grant

BS = 4


def _pull(**kw: object) -> KVPullRequest:
    base = dict(transfer_id="t", consumer_address="127.0.0.1:1", first_block=1, num_blocks=3,
                num_layers=2, dtype="bfloat16", block_shape=[4, 2, 8], timeout_s=5.0)
    base.update(kw)
    return KVPullRequest(**base)  # type: ignore[arg-type]


def _header(**kw: object) -> KVSendHeader:
    base = dict(transfer_id="t", producer_address="p:1", producer_epoch="e", seq=1, first_block=1,
                num_blocks=3, num_layers=2, dtype="bfloat16", block_shape=[4, 2, 8],
                layers_per_call=1)
    base.update(kw)
    return KVSendHeader(**base)  # type: ignore[arg-type]


# ---- messages ---------------------------------------------------------------------------

def test_codec_round_trip_and_rejects() -> None:
    codec = CONTROL_CODEC
    pull = _pull()
    assert codec.decode(codec.encode(pull)) == pull
    bad = codec.encode(pull).replace(b"bfloat16", b"bfloat1X")
    assert codec.decode(bad).dtype == "bfloat1X"  # schema-valid, caught by check_pull
    with pytest.raises(MessageDecodeError):
        codec.decode(b"\x93garbage")


def test_sealed_codec_refuses_edited_replayed_and_unsealed_messages() -> None:
    sender, receiver = make_codec(sender_id="d"), make_codec(sender_id="p")
    pull = _pull()
    sealed = sender.encode(pull)
    assert receiver.decode(sealed) == pull
    reasons = []
    for payload in (sealed, sealed.replace(b"bfloat16", b"bfloat1X"), CONTROL_CODEC.encode(pull),
                    make_codec(ClusterSecret(b"k" * 32)).encode(pull)):
        with pytest.raises(TrustRefusal) as info:
            receiver.decode(payload)
        reasons.append(info.value.reason)
    assert reasons == ["replayed", "forged", "malformed", "forged"]
    assert receiver.refusals.total == 4


def test_check_pull_and_header() -> None:
    assert check_pull(_pull(), 2, "bfloat16", [4, 2, 8]) is None
    assert "mismatch" in check_pull(_pull(), 3, "bfloat16", [4, 2, 8])
    assert check_pull(_pull(dtype="int7"), 2, "bfloat16", [4, 2, 8])
    assert check_pull(_pull(first_block=-1), 2, "bfloat16", [4, 2, 8])
    assert check_pull(_pull(block_shape=[4, 2]), 2, "bfloat16", [4, 2, 8])
    # A route between tensor-parallel layouts asks for a slice of each block's KV heads.
    assert check_pull(_pull(block_shape=[4, 1, 8]), 2, "bfloat16", [4, 2, 8]) is None
    assert "mismatch" in check_pull(_pull(block_shape=[4, 3, 8]), 2, "bfloat16", [4, 2, 8])
    assert "mismatch" in check_pull(_pull(block_shape=[4, 1, 4]), 2, "bfloat16", [4, 2, 8])
    pull = _pull()
    assert check_header(_header(), pull, None) is None
    assert check_header(_header(seq=5), pull, 4) is None
    assert "sequence" in check_header(_header(seq=4), pull, 4)
    assert check_header(_header(num_blocks=4), pull, None)
    assert check_header(_header(transfer_id="u"), pull, None)
    assert check_header(_header(num_layers=0), pull, None)
    assert check_header(_header(layers_per_call=2), pull, None) is None
    assert "layers_per_call" in check_header(_header(layers_per_call=0), pull, None)
    assert "layers_per_call" in check_header(_header(layers_per_call=3), pull, None)
    capped = _pull(max_layers_per_call=1)  # the consumer's receive slot holds one layer
    assert check_header(_header(layers_per_call=1), capped, None) is None
    assert "above the requested" in check_header(_header(layers_per_call=2), capped, None)
    assert "max_layers_per_call" in check_pull(_pull(max_layers_per_call=-1), 2, "bfloat16",
                                               [4, 2, 8])
    assert check_pull(_pull(max_layers_per_call=5000), 2, "bfloat16", [4, 2, 8])
    assert "transfer id" in check_pull(_pull(transfer_id="x" * 1025), 2, "bfloat16", [4, 2, 8])
    assert check_pull(_pull(transfer_id="x" * 1024), 2, "bfloat16", [4, 2, 8]) is None
    for timeout in (-1.0, float("nan"), 1e9):
        assert "timeout_s" in check_pull(_pull(timeout_s=timeout), 2, "bfloat16", [4, 2, 8])


def test_plan_layers_per_call() -> None:
    mb = 1 << 20
    assert plan_layers_per_call(36, 8 * mb, 0) == 1          # 0: one call per layer
    assert plan_layers_per_call(36, 8 * mb, 8 * mb) == 1     # a layer fills a call alone
    assert plan_layers_per_call(36, mb // 2, 32 * mb) == 36  # 18 MB in all: one call
    assert plan_layers_per_call(36, 2 * mb, 32 * mb) == 18   # 72 MB: two calls of 36 MB
    assert plan_layers_per_call(1, mb, 32 * mb) == 1
    assert plan_layers_per_call(36, mb // 2, 32 * mb, max_layers=14) == 14  # D's slot caps it
    assert plan_layers_per_call(36, 2 * mb, 32 * mb, max_layers=20) == 18  # under the cap
    assert plan_layers_per_call(36, 2 * mb, 0, max_layers=20) == 1
    assert call_ranges(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert call_ranges(3, 3) == [(0, 3)]


# ---- receive buffer ---------------------------------------------------------------------

def test_recv_buffer_exact_accounting() -> None:
    buf = RecvBuffer(100)
    assert buf.try_reserve("a", 60)
    assert not buf.try_reserve("b", 41)
    assert buf.in_use_bytes == 60
    assert buf.try_reserve("b", 40)
    assert buf.in_use_bytes == 100
    with pytest.raises(KeyError):
        buf.try_reserve("a", 0)
    assert buf.release("a") == 60 and buf.release("a") == 0
    assert not buf.fits_ever(101)
    assert buf.release("b") == 40 and buf.in_use_bytes == 0 and buf.holders() == []


def test_recv_buffer_threads() -> None:
    buf = RecvBuffer(1000)

    def churn(prefix: str) -> None:
        for i in range(500):
            if buf.try_reserve(f"{prefix}{i}", 7):
                buf.release(f"{prefix}{i}")

    threads = [threading.Thread(target=churn, args=(str(k),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert buf.in_use_bytes == 0


# ---- block copy -------------------------------------------------------------------------

def _stacked_cache(num_layers: int, num_blocks: int, dtype: torch.dtype,
                   gen: torch.Generator) -> list[torch.Tensor]:
    shape = KVCacheShape(num_layers, num_blocks, 4, 2, 8, dtype)
    caches = allocate_kv_caches(shape, "cpu")
    stack_layers(caches).view(torch.uint8).copy_(
        torch.randint(0, 256, stack_layers(caches).view(torch.uint8).shape, generator=gen,
                      dtype=torch.uint8))
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_gather_scatter_bit_exact(dtype: torch.dtype) -> None:
    """Any run of layers gathers with one call and all layers scatter with one; every byte
    (NaN patterns of random bits included) arrives, and no other block is touched."""
    gen = torch.Generator().manual_seed(0)
    source_layers = _stacked_cache(5, 37, dtype, gen)
    target_layers = _stacked_cache(5, 53, dtype, gen)
    source, target = stack_layers(source_layers), stack_layers(target_layers)
    before = target.view(torch.uint8).clone()
    src_ids, dst_ids = [36, 0, 5, 17, 18, 3], [52, 1, 9, 0, 30, 2]
    src_index, dst_index = block_ids_tensor(src_ids, "cpu"), block_ids_tensor(dst_ids, "cpu")
    buffer = torch.empty(wire_shape(5, 6, [4, 2, 8]), dtype=dtype)
    gather_layers(source, 0, 2, src_index, out=buffer[0:2])
    gather_layers(source, 2, 5, src_index, out=buffer[2:5])
    scatter_layers(target, dst_index, buffer)
    for layer in range(5):
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(target_layers[layer][:, d].view(torch.uint8),
                               source_layers[layer][:, s].view(torch.uint8))
    untouched = sorted(set(range(53)) - set(dst_ids))
    assert torch.equal(target.view(torch.uint8)[:, :, untouched], before[:, :, untouched])


def test_stack_layers_rejects_separate_allocations() -> None:
    caches = [torch.zeros(2, 3, 4, 2, 8) for _ in range(3)]
    with pytest.raises(KVTransferError, match="one allocation"):
        stack_layers(caches)
    whole = allocate_kv_caches(KVCacheShape(3, 3, 4, 2, 8, torch.float32), "cpu")
    with pytest.raises(KVTransferError, match="one allocation"):
        stack_layers([whole[0], whole[2], whole[1]])
    assert stack_layers(whole).shape == (3, 2, 3, 4, 2, 8)


# ---- control channel --------------------------------------------------------------------

def test_control_channel_round_trip_and_malformed() -> None:
    codec = make_codec()
    got: list[tuple[object, int]] = []
    event = threading.Event()

    def handler(message: object, frames: list) -> None:
        got.append((message, len(frames)))
        if len(got) == 2:
            event.set()

    address = f"127.0.0.1:{free_port()}"
    server = ControlServer(address, codec, handler, poll_interval_s=0.01)
    server.start()
    client = ControlClient(address, codec, send_timeout_s=1.0)
    try:
        client.send(_pull())
        client._socket.send_multipart([b"not msgpack"])  # counted and dropped
        client.send(_header(), [b"x" * 10])
        assert event.wait(5)
        assert got[0] == (_pull(), 0) and got[1] == (_header(), 1)
        assert server.messages_rejected == 1 and server.messages_received == 2
    finally:
        client.close()
        server.stop()


def test_control_client_to_dead_peer_never_blocks() -> None:
    client = ControlClient(f"127.0.0.1:{free_port()}", make_codec(), send_timeout_s=0.2)
    start = time.monotonic()
    client.send(_pull())  # queued while connecting; closing drops it at once (linger 0)
    client.close()
    assert time.monotonic() - start < 1.0


# ---- scheduler side ---------------------------------------------------------------------

OWN_ADDRESS = "127.0.0.1:14579"  # KVTransferConfig's default kv_ip:kv_port


def _req(request_id: str, length: int, flag: str | None, transfer_id: str = "T") -> Request:
    params = granted_params({"transfer_id": transfer_id, flag: True, "remote_kv_address": "h:1"},
                            OWN_ADDRESS) if flag else None
    return Request(request_id=request_id, prompt_token_ids=list(range(length)),
                   sampling_params=SamplingParams(max_tokens=1), kv_transfer_params=params)


def _sched(role: str) -> P2pConnectorScheduler:
    return P2pConnectorScheduler(KVTransferConfig(kv_role=role), BS)


def _out(new: list[NewRequestData] = (), cached: list[CachedRequestData] = (),
         scheduled: dict[str, int] | None = None) -> SchedulerOutput:
    scheduled = scheduled or {}
    return SchedulerOutput(list(new), list(cached), scheduled, sum(scheduled.values()))


def test_create_connector_null_and_p2p() -> None:
    plain = EngineConfig(model=ModelConfig(model="m"))
    sched, _ = create_connector(plain, "cpu")
    assert isinstance(sched, NullConnectorScheduler)
    sched, worker = create_connector(plain.with_changes(kv_transfer=KVTransferConfig()), "cpu")
    assert isinstance(sched, P2pConnectorScheduler)
    worker.shutdown()


@pytest.mark.parametrize("length,local,expected", [
    (1, 0, 0), (2, 0, 1), (BS - 1, 0, BS - 2), (BS, 0, BS - 1), (BS + 1, 0, BS),
    (BS + 1, BS, 0), (3 * BS, BS, 2 * BS - 1), (3 * BS + 1, 3 * BS, 0),
])
def test_consumer_matched_tokens(length: int, local: int, expected: int) -> None:
    sched = _sched("kv_consumer")
    match = sched.get_num_new_matched_tokens(_req("r", length, "do_remote_prefill"), local)
    assert match.num_tokens == expected and match.is_async == (expected > 0)
    meta = sched.build_connector_meta(_out())
    assert len(meta.releases) == (1 if expected == 0 else 0)


def test_consumer_load_lifecycle_and_preemption() -> None:
    sched = _sched("kv_consumer")
    req = _req("r", 3 * BS + 2, "do_remote_prefill")
    match = sched.get_num_new_matched_tokens(req, BS)
    assert match.num_tokens == 2 * BS + 1
    sched.update_state_after_alloc(req, [7, 8, 9, 10], BS, match.num_tokens)
    meta = sched.build_connector_meta(_out())
    (load,) = meta.loads
    assert load.block_ids == [8, 9, 10] and load.first_block == 1 and load.transfer_id == "T"
    assert not sched.build_connector_meta(_out()).loads
    sched.update_finished(FinishedTransfers(recving={"r"}))
    # Preempted after its KV arrived: rescheduled from scratch, it computes locally.
    assert sched.get_num_new_matched_tokens(req, 0).num_tokens == 0
    assert sched.request_finished(req, [1]) == (False, None)
    assert sched.is_idle()


def test_consumer_abort_while_loading_cancels_and_holds_the_blocks() -> None:
    """A request ended while its load runs: the load is cancelled, and its blocks are held
    (the receives scatter into them as calls land) until the worker reports the load ended."""
    sched = _sched("kv_consumer")
    req = _req("r", 10, "do_remote_prefill")
    sched.update_state_after_alloc(req, [1, 2, 3], 0, 9)
    sched.build_connector_meta(_out())
    assert sched.request_finished(req, [1, 2, 3]) == (True, None)
    assert sched.build_connector_meta(_out()).cancels == ["r"]
    assert sched.is_idle()


def test_consumer_abort_before_the_worker_saw_the_load_holds_nothing() -> None:
    sched = _sched("kv_consumer")
    req = _req("r", 10, "do_remote_prefill")
    sched.update_state_after_alloc(req, [1, 2, 3], 0, 9)
    assert sched.request_finished(req, [1, 2, 3]) == (False, None)
    assert sched.build_connector_meta(_out()).cancels == []


def test_consumer_loads_that_end_before_their_pull_release_the_producer() -> None:
    """A load aborted before the worker saw it, one with a layer larger than kv_buffer_size,
    and one cancelled while pushed back: none sent its pull, and each tells P to drop what it keeps
    (a pull of 0 blocks) instead of leaving P to its lease."""
    from connectors.p2p_nccl.connector_worker import P2pConnectorWorker

    got: list[KVPullRequest] = []
    producer = f"127.0.0.1:{free_port()}"
    server = ControlServer(producer, make_codec(), lambda message, frames: got.append(message))
    server.start()
    block_shape = (16, 2, 64)  # block size, KV heads, head dim
    per_block = 2 * 2 * 16 * 2 * 64 * 2  # 2 layers x K/V x block x bf16: 16 KiB (a size in
    # bytes: kv_buffer_size below 1e4 would mean GB)
    config = KVTransferConfig(kv_role="kv_consumer", kv_port=free_port(),
                              kv_buffer_size=6 * per_block)
    sched = P2pConnectorScheduler(config, block_shape[0])
    worker = P2pConnectorWorker(config, "cpu")
    worker.register_kv_caches(allocate_kv_caches(KVCacheShape(2, 64, *block_shape, torch.bfloat16),
                                                 "cpu"))

    def load(request_id: str, blocks: int) -> Request:
        req = Request(request_id=request_id, prompt_token_ids=list(range(16 * blocks + 1)),
                      sampling_params=SamplingParams(max_tokens=1),
                      kv_transfer_params=granted_params({"do_remote_prefill": True,
                                                         "transfer_id": f"T{request_id}",
                                                         "remote_kv_address": producer},
                                                        worker.address))
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, list(range(blocks)), 0, 16 * blocks)
        return req

    try:
        aborted = load("aborted", 2)
        sched.request_finished(aborted, list(range(2)))  # before any metadata was built
        load("huge", 13)  # one layer of it (13 x 8 KiB) is over the buffer: it cannot stream
        load("first", 5)  # takes the buffer and sends its pull
        queued = load("queued", 5)  # pushed back behind it
        worker.start_load_kv(sched.build_connector_meta(_out()))
        sched.request_finished(queued, list(range(5)))
        worker.start_load_kv(sched.build_connector_meta(_out()))
        deadline = time.monotonic() + 5.0
        while len(got) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        pulls = sorted((m.transfer_id, m.num_blocks) for m in got)
        assert pulls == [("Taborted", 0), ("Tfirst", 5), ("Thuge", 0), ("Tqueued", 0)]
    finally:
        worker.shutdown()
        server.stop()


def test_rejected_pulls_naming_new_peers_start_a_bounded_number_of_senders() -> None:
    """A producer answers a rejected pull with an abort to the address it names; pulls
    naming ever new addresses (all on loopback here) must not start a thread each."""
    from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
    from connectors.p2p_nccl.peer_senders import MAX_ABORT_PEERS

    port = free_port()
    worker = P2pConnectorWorker(KVTransferConfig(kv_role="kv_producer", kv_port=port), "cpu")
    worker.register_kv_caches(allocate_kv_caches(KVCacheShape(2, 16, 4, 2, 4, torch.bfloat16),
                                                 "cpu"))
    client = ControlClient(f"127.0.0.1:{port}", make_codec())
    try:
        count = MAX_ABORT_PEERS + 40
        for i in range(count):  # 3 layers against the producer's 2: rejected, abort owed
            consumer = f"127.0.0.1:{40000 + i}"
            client.send(KVPullRequest(f"t{i}", consumer, 0, 1, 3, "bfloat16", [4, 2, 4], 1.0,
                                      grant=transfer_grant(f"t{i}", worker.address, consumer)))
        deadline = time.monotonic() + 5.0
        while worker.stats()["messages_rejected"] < 2 * count - MAX_ABORT_PEERS \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.stats()["messages_rejected"] == 2 * count - MAX_ABORT_PEERS
        assert len(worker.producer_side._peers) == MAX_ABORT_PEERS
    finally:
        client.close()
        worker.shutdown()


def test_consumer_finished_before_asking_releases_the_producer() -> None:
    """Aborted while queued, or ended by the token it continues from: P is told to drop
    the blocks it holds for the transfer at once (not at its lease's end); once only."""
    sched = _sched("kv_consumer")
    req = _req("r", 10, "do_remote_prefill", transfer_id="T9")
    assert sched.request_finished(req, []) == (False, None)
    (notice,) = sched.build_connector_meta(_out()).releases
    assert (notice.transfer_id, notice.peer_address) == ("T9", "h:1")
    assert sched.is_idle()
    # A request that did ask (its load landed) sends nothing more.
    sched.update_state_after_alloc(req, [1, 2, 3], 0, 9)
    sched.build_connector_meta(_out())
    sched.update_finished(FinishedTransfers(recving={"r"}))
    sched.request_finished(req, [1, 2, 3])
    assert not sched.build_connector_meta(_out()).releases
    assert sched.is_idle()


def test_consumer_failed_load_then_recompute() -> None:
    sched = _sched("kv_consumer")
    req = _req("r", 10, "do_remote_prefill")
    sched.update_state_after_alloc(req, [1, 2, 3], 0, 9)
    sched.build_connector_meta(_out())
    sched.update_finished(FinishedTransfers(failed_recving={"r"}))
    assert sched.get_num_new_matched_tokens(req, 0).num_tokens == 0
    sched.request_finished(req, [])
    assert sched.is_idle()


def test_producer_saves_on_final_chunk_and_holds() -> None:
    sched = _sched("kv_producer")
    req = _req("p", 2 * BS + 1, "do_remote_decode")  # 9 tokens: send 8 = 2 blocks
    assert sched.get_num_new_matched_tokens(req, 0).num_tokens == 0
    new = NewRequestData("p", req.prompt_token_ids, 9, req.sampling_params, [4, 5], 0)
    assert not sched.build_connector_meta(_out([new], scheduled={"p": 8})).saves
    # The final chunk (1 token) adds a block; it is still the save step.
    cached = CachedRequestData("p", [6], 8)
    (save,) = sched.build_connector_meta(_out(cached=[cached], scheduled={"p": 1})).saves
    assert save.block_ids == [4, 5] and save.num_tokens == 8 and save.transfer_id == "T"
    hold, params = sched.request_finished(req, [4, 5, 6])
    assert hold and params.transfer_id == "T"
    assert sched.stats()["held_requests"] == 1
    sched.update_finished(FinishedTransfers(sending={"p"}))
    assert sched.is_idle()


def test_producer_pins_its_blocks_from_save_until_sent() -> None:
    """Between its save step and the end of its send a producer request must not be
    preempted: the worker gathers the saved block ids when D's pull arrives."""
    sched = _sched("kv_producer")
    req = _req("p", BS + 1, "do_remote_decode")
    sched.get_num_new_matched_tokens(req, 0)
    assert not sched.pins_blocks(req)
    new = NewRequestData("p", req.prompt_token_ids, BS + 1, req.sampling_params, [3, 4], 0)
    assert sched.build_connector_meta(_out([new], scheduled={"p": BS + 1})).saves
    assert sched.pins_blocks(req)
    sched.update_finished(FinishedTransfers(sending={"p"}))
    assert not sched.pins_blocks(req)  # sent: a preemption can no longer change what went out
    consumer = _sched("kv_consumer")
    assert not consumer.pins_blocks(_req("c", BS + 1, "do_remote_prefill"))


def test_producer_send_done_before_request_finished() -> None:
    sched = _sched("kv_producer")
    req = _req("p", BS + 1, "do_remote_decode")
    sched.get_num_new_matched_tokens(req, BS)  # prefix hit on P
    new = NewRequestData("p", req.prompt_token_ids, BS + 1, req.sampling_params, [3, 4], BS)
    assert sched.build_connector_meta(_out([new], scheduled={"p": 1})).saves
    sched.update_finished(FinishedTransfers(sending={"p"}))
    assert sched.request_finished(req, [3, 4])[0] is False
    assert sched.is_idle()


def test_producer_one_token_prompt_and_abort_before_save() -> None:
    sched = _sched("kv_producer")
    one = _req("one", 1, "do_remote_decode", "T1")
    sched.get_num_new_matched_tokens(one, 0)
    new = NewRequestData("one", [0], 1, one.sampling_params, [2], 0)
    meta = sched.build_connector_meta(_out([new], scheduled={"one": 1}))
    assert not meta.saves and [n.transfer_id for n in meta.abandons] == ["T1"]
    assert sched.request_finished(one, [2])[0] is False
    aborted = _req("ab", 20, "do_remote_decode", "T2")
    sched.get_num_new_matched_tokens(aborted, 0)
    assert sched.request_finished(aborted, [])[0] is False
    assert [n.transfer_id for n in sched.build_connector_meta(_out()).abandons] == ["T2"]
    assert sched.is_idle()


def test_colocated_requests_ignored() -> None:
    sched = _sched("kv_both")
    req = _req("c", 20, None)
    assert sched.get_num_new_matched_tokens(req, 0).num_tokens == 0
    assert sched.request_finished(req, [1]) == (False, None)
    assert sched.build_connector_meta(_out()).is_empty
    assert sched.is_idle()


def test_deferred_send_uploads_block_ids_on_the_gathering_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deferred send's block ids are uploaded inside the transport's gather context (on
    CUDA: the stream that gathers), never on the caller's stream: a gather on the NCCL pair's
    stream, ordered only after the step's event, could otherwise read ids not yet uploaded
    (the prefill worker's illegal memory access of 2026-11-24). The gathered bytes are the
    blocks the pull asked for."""
    import contextlib

    from connectors.cpu_transport import CpuTransport
    from connectors.p2p_nccl import producer, send_jobs
    from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
    from connectors.p2p_nccl.metadata import SaveSpec

    class ContextTransport(CpuTransport):
        inside = False

        @contextlib.contextmanager
        def gather_context(self, peer_address: str, event: object):  # type: ignore[override]
            self.inside = True
            try:
                yield
            finally:
                self.inside = False

    transport = ContextTransport()
    uploads: list[bool] = []

    def recording_upload(block_ids: list[int], device: object) -> torch.Tensor:
        uploads.append(transport.inside)
        return block_ids_tensor(block_ids, device)

    monkeypatch.setattr(send_jobs, "block_ids_tensor", recording_upload)
    worker = P2pConnectorWorker(
        KVTransferConfig(kv_role="kv_producer", kv_port=free_port()), "cpu", transport=transport)
    try:
        caches = _stacked_cache(2, 16, torch.bfloat16, torch.Generator().manual_seed(3))
        worker.register_kv_caches(caches)
        jobs: list = []
        monkeypatch.setattr(worker.producer_side, "_submit", jobs.append)
        save = SaveSpec("r", "t", "127.0.0.1:1", block_ids=[9, 4, 11, 2], num_tokens=15)
        pull = _pull(first_block=1, num_blocks=3)  # the consumer caches block 9 already
        worker.producer_side._start_deferred(
            producer.PendingSave(save, lease_deadline=0.0, ready=True), pull, worker.state.clock())
        (job,) = jobs
        assert uploads == []  # nothing uploaded before the sender gathers
        first, second = job.call_source(0, 1), job.call_source(1, 2)
        assert uploads == [True]  # once, inside the context
        stacked = stack_layers(caches)
        for layer, (out, _) in enumerate((first, second)):
            assert torch.equal(out[0].view(torch.int16), stacked[layer][:, [4, 11, 2]].view(torch.int16))
    finally:
        worker.shutdown()


def test_orphan_pull_is_dropped_after_its_ttl() -> None:
    """A pull for a transfer this producer never saves (it was meant for a dead process at
    the same address) is kept for ``orphan_ttl_s``, then dropped and counted."""
    from connectors.p2p_nccl.connector_worker import P2pConnectorWorker

    now = [100.0]
    worker = P2pConnectorWorker(
        KVTransferConfig(kv_role="kv_producer", kv_port=free_port(), orphan_ttl_s=4.0), "cpu",
        clock=lambda: now[0])
    try:
        worker.register_kv_caches(_stacked_cache(2, 16, torch.bfloat16,
                                                 torch.Generator().manual_seed(5)))
        worker.producer_side.on_pull(_pull(
            transfer_id="orphan", grant=transfer_grant("orphan", worker.address, "127.0.0.1:1")))
        assert not worker.is_idle()
        now[0] += 3.9
        worker.get_finished()
        assert worker.stats()["registrations_expired"] == 0 and not worker.is_idle()
        now[0] += 0.2
        worker.get_finished()
        assert worker.stats()["registrations_expired"] == 1 and worker.is_idle()
    finally:
        worker.shutdown()
