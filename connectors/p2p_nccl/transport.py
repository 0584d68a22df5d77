"""NCCL data plane: one 2-rank communicator per (producer, consumer) pair.

The producer (rank 0) creates the unique id on first contact and sends it in a
``NcclHello`` over the ZMQ control channel; the consumer (rank 1) joins on a helper thread.
Each pair has its own CUDA stream. Every data call runs under a deadline watched by a
watchdog thread, which aborts the communicator of a late pair (so no call blocks forever);
an aborted pair is rebuilt on the next contact. A restarted process at a known address has
no pair: a restarted producer sends a hello at first contact (which replaces the consumer's
pair), and the producer's worker aborts its pair with a consumer whose pulls carry a new
``consumer_epoch``, so its next send re-handshakes. cupy is imported lazily: CPU engines
and the CPU test suite never need it. Its GPU tests: ``pytest -m gpu tests/connectors``
(two GPUs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors.p2p_nccl.handshake import ControlClient
from connectors.p2p_nccl.messages import KVSendHeader, NcclHello
from engine_core.config import KVTransferConfig
from engine_core.errors import KVTransferError

logger = logging.getLogger(__name__)

INIT_TIMEOUT_S = 30.0


def _nccl() -> Any:
    from cupy.cuda import nccl  # lazy: only GPU engines import cupy

    return nccl


def unique_id_to_bytes(unique_id: bytes | tuple[int, ...]) -> bytes:
    """cupy's unique id as bytes for the wire (cupy 14 returns bytes, older ones a tuple)."""
    if isinstance(unique_id, bytes):
        return unique_id
    return bytes(b % 256 for b in unique_id)


def _new_communicator(data: bytes, rank: int) -> Any:
    """Join a 2-rank communicator; cupy 14 takes the id as bytes, older ones as signed chars."""
    nccl = _nccl()
    try:
        return nccl.NcclCommunicator(2, data, rank)
    except TypeError:
        return nccl.NcclCommunicator(2, tuple(b - 256 if b > 127 else b for b in data), rank)


def set_nccl_channels(num_channels: int) -> None:
    """Apply ``nccl_num_channels`` the way NCCL reads it: from the environment at comm init.

    NCCL has no per-call channel count; it reads NCCL_MIN/MAX_NCHANNELS when a communicator
    is created. This transport creates every communicator of the engine process, so setting
    them here (before the first pair) scopes the choice to the KV connector's process.
    """
    for name in ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"):
        previous = os.environ.get(name)
        if previous not in (None, str(num_channels)):
            logger.warning("nccl_num_channels=%d overrides %s=%s", num_channels, name, previous)
        os.environ[name] = str(num_channels)


def _raise(exc: Exception) -> Callable[[], bool]:
    def poll() -> bool:
        raise KVTransferError(str(exc))

    return poll


class LandingWatcher:
    """One thread per receiving pair: waits for each posted receive's completion event, in
    posting order, and calls its callback (the consumer's doorbell).

    Why a thread: the engine loop would otherwise notice a landed transfer only at its next
    poll. The events are blocking-sync events, so the wait sleeps in the driver without the
    GIL instead of polling. An aborted pair's NCCL kernels end (ncclCommAbort), so its events
    complete and the thread drains; ``stop`` ends it after the queued waits.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.Queue[tuple[Any, Callable[[], None]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, event: Any, callback: Callable[[], None]) -> None:
        """Call ``callback`` once ``event`` (anything with ``synchronize()``) completed."""
        self._queue.put((event, callback))

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, callback = item
            try:
                event.synchronize()
            except Exception as exc:  # a failed wait still wakes the loop, which polls
                logger.warning("waiting for a KV receive failed: %s", exc)
            try:
                callback()
            except Exception:  # the callback is a doorbell ring; never kill the thread
                logger.exception("KV landing callback failed")


@dataclass(frozen=True)
class PostedRecv:
    """A transfer's posted receives. ``poll``: True once every call landed (and its
    ``after_each`` work ran), raises once the pair failed. ``drained``: whether the pair's
    stream has passed all of it, landed or not: after a failure (an aborted pair's kernels
    end), the work queued behind the receives still runs, so what it writes is only safe to
    reuse once this is True."""

    poll: Callable[[], bool]
    drained: Callable[[], bool]


class RecvPostError(KVTransferError):
    """``post_recv`` failed after queuing part of its work: ``posted`` says when the pair's
    stream has passed that part (its scatters may still write until then)."""

    def __init__(self, message: str, posted: PostedRecv) -> None:
        super().__init__(message)
        self.posted = posted


@dataclass
class _Pair:
    peer_address: str
    rank: int
    stream: torch.cuda.Stream
    comm: Any = None
    init_deadline: float = 0.0  # a pair still joining after this is given up and replaced
    ready: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    aborted: bool = False
    op_deadline: float | None = None  # set while a data call is outstanding (watchdog)
    send_start: Any = None  # timing event before the current transfer's first send
    # Receiving pairs: how many times receives were posted. Only the landing of the latest
    # post clears ``op_deadline`` (both under the transport's lock): an earlier load landing,
    # even while the next one is being posted, says nothing of receives queued behind it.
    posts: int = 0
    watcher: LandingWatcher | None = None  # receiving pairs: wakes the engine on each landing


class NcclPairTransport:
    """Pair communicators keyed by (direction, peer address), with a watchdog."""

    name = "nccl"
    uses_data_messages = False

    def __init__(self, device: str, config: KVTransferConfig, watchdog_interval_s: float = 0.2) -> None:
        self._device = torch.device(device)
        if self._device.type != "cuda":
            raise KVTransferError("the NCCL transport needs a CUDA device")
        self._device_index = self._device.index if self._device.index is not None else torch.cuda.current_device()
        self._own_address = f"{config.kv_ip}:{config.kv_port}"
        self._epoch = uuid.uuid4().hex
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = watchdog_interval_s
        self._watchdog = threading.Thread(target=self._watch, name="kv-nccl-watchdog", daemon=True)
        self._watchdog.start()
        self.data_calls = 0
        self.recv_gpu_seconds = 0.0  # GPU time from posting a transfer's receives (and
        # scatters) to their end
        self.send_gpu_seconds = 0.0  # GPU time from a transfer's first send (data ready) to its end
        if config.nccl_num_channels is not None:
            set_nccl_channels(config.nccl_num_channels)

    # ---- producer (rank 0) --------------------------------------------------------------

    def open_pair(self, client: ControlClient, peer_address: str, deadline: float) -> None:
        """Create the pair on first contact (or after an abort); no-op when it is healthy.

        A pair still joining is waited for, not replaced: its init (first NCCL use of a
        fresh process takes seconds) outlives the deadline of the transfer that started it,
        and replacing it per transfer would never let one finish. Only a pair still joining
        after ``INIT_TIMEOUT_S`` is given up.
        """
        key = ("send", peer_address)
        now = time.monotonic()
        with self._lock:
            pair = self._pairs.get(key)
        if pair is not None and pair.ready.is_set() and pair.error is None and not pair.aborted:
            return
        joining = (pair is not None and not pair.ready.is_set() and not pair.aborted
                   and pair.error is None and now < pair.init_deadline)
        if not joining:
            if pair is not None:
                self.abort(peer_address)
            nccl = _nccl()
            with torch.cuda.device(self._device_index):
                unique_id = unique_id_to_bytes(nccl.get_unique_id())
                pair = _Pair(peer_address, 0, torch.cuda.Stream(self._device),
                             init_deadline=now + INIT_TIMEOUT_S)
            with self._lock:
                self._pairs[key] = pair
            client.send(NcclHello(self._own_address, self._epoch, unique_id))
            self._init_async(pair, unique_id)
        assert pair is not None
        if not pair.ready.wait(max(0.0, min(deadline, pair.init_deadline) - time.monotonic())):
            raise KVTransferError(f"NCCL pair with {peer_address} still joining at the deadline")
        if pair.error is not None:
            raise KVTransferError(f"NCCL pair with {peer_address}: {pair.error}")

    def send_call(self, client: ControlClient, header: KVSendHeader, first_layer: int,
                   buffer: torch.Tensor, event: Any, deadline: float) -> None:
        """One ncclSend of a contiguous run of layers (bytes), on the pair's stream."""
        pair = self._live_pair("send", client.address)
        nccl = _nccl()
        with torch.cuda.stream(pair.stream):
            if event is not None:
                pair.stream.wait_event(event)
            if pair.send_start is None:
                pair.send_start = torch.cuda.Event(enable_timing=True)
                pair.send_start.record(pair.stream)
            buffer.record_stream(pair.stream)
            pair.op_deadline = deadline
            pair.comm.send(buffer.data_ptr(), buffer.numel() * buffer.element_size(),
                           nccl.NCCL_UINT8, 1, pair.stream.cuda_stream)
        self.data_calls += 1

    def finish_sends(self, peer_address: str, deadline: float) -> None:
        """Wait (polling, under the deadline) until the pair's posted sends completed."""
        pair = self._live_pair("send", peer_address)
        done = torch.cuda.Event(enable_timing=True)
        done.record(pair.stream)
        self._wait(pair, done, deadline)
        pair.op_deadline = None
        if pair.send_start is not None:
            self.send_gpu_seconds += pair.send_start.elapsed_time(done) / 1e3
            pair.send_start = None

    @contextlib.contextmanager
    def gather_context(self, peer_address: str, event: Any) -> Iterator[None]:
        """Run a deferred gather on the pair's stream, after the step that wrote the blocks."""
        pair = self._live_pair("send", peer_address)
        with torch.cuda.stream(pair.stream):
            if event is not None:
                pair.stream.wait_event(event)
            yield

    # ---- consumer (rank 1) --------------------------------------------------------------

    def on_hello(self, hello: NcclHello) -> None:
        """A producer (re)opens our pair: drop any old communicator and join the new one."""
        key = ("recv", hello.producer_address)
        with self._lock:
            old = self._pairs.pop(key, None)
        if old is not None:
            self._abort_pair(old)
        with torch.cuda.device(self._device_index):
            pair = _Pair(hello.producer_address, 1, torch.cuda.Stream(self._device))
        with self._lock:
            self._pairs[key] = pair
        self._init_async(pair, hello.unique_id)

    def post_recv(self, peer_address: str, buffers: list[torch.Tensor], ready: Any = None,
                  on_landed: Callable[[], None] | None = None,
                  after_each: Callable[[int], None] | None = None) -> PostedRecv:
        """Post one ncclRecv per call on the pair's stream, after ``ready`` (the buffers'
        allocation on the engine's stream: until then their memory may still be read by an
        earlier tensor's kernels), each followed by ``after_each(i)`` on the same stream (the
        consumer's scatter of call i, so a buffer may serve several calls in turn); returns
        non-blocking polls. ``on_landed`` is called from the pair's watcher thread once they
        completed."""
        with self._lock:
            pair = self._pairs.get(("recv", peer_address))
        if pair is None or not pair.ready.wait(5.0) or pair.error is not None or pair.aborted:
            raise KVTransferError(f"no NCCL pair with {peer_address}")
        nccl = _nccl()
        with self._lock:
            pair.posts += 1
            post = pair.posts
            pair.op_deadline = time.monotonic() + INIT_TIMEOUT_S
        with torch.cuda.stream(pair.stream):
            if ready is not None:
                pair.stream.wait_event(ready)
            start = torch.cuda.Event(enable_timing=True)
            start.record(pair.stream)
            try:
                for index, buffer in enumerate(buffers):
                    buffer.record_stream(pair.stream)
                    pair.comm.recv(buffer.data_ptr(), buffer.numel() * buffer.element_size(),
                                   nccl.NCCL_UINT8, 0, pair.stream.cuda_stream)
                    self.data_calls += 1
                    if after_each is not None:
                        after_each(index)
            except Exception as exc:  # e.g. the pair aborted meanwhile: part is queued
                queued = torch.cuda.Event()
                queued.record(pair.stream)
                raise RecvPostError(f"posting receives from {peer_address} failed: {exc}",
                                    PostedRecv(poll=_raise(exc), drained=queued.query)) from exc
            done = torch.cuda.Event(enable_timing=True, blocking=True)
            done.record(pair.stream)
        if on_landed is not None:
            if pair.watcher is None:
                pair.watcher = LandingWatcher(f"kv-landing-{peer_address}")
            pair.watcher.watch(done, on_landed)

        def poll() -> bool:
            if pair.aborted or pair.error is not None:
                raise KVTransferError(f"NCCL pair with {peer_address} failed: {pair.error}")
            if done.query():
                with self._lock:
                    if pair.posts == post:
                        pair.op_deadline = None
                self.recv_gpu_seconds += start.elapsed_time(done) / 1e3
                return True
            return False

        return PostedRecv(poll=poll, drained=done.query)

    def count_recv_call(self) -> None:
        return None

    # ---- failure handling ---------------------------------------------------------------

    def abort(self, peer_address: str) -> None:
        """Abort every pair with this peer; the next contact rebuilds them."""
        with self._lock:
            pairs = [self._pairs.pop(key) for key in list(self._pairs) if key[1] == peer_address]
        for pair in pairs:
            self._abort_pair(pair)

    def close(self) -> None:
        """Stop the watchdog and abort every communicator."""
        self._stop.set()
        self._watchdog.join(5.0)
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            self._abort_pair(pair)

    def _init_async(self, pair: _Pair, unique_id: bytes) -> None:
        """ncclCommInitRank blocks until both ranks join: run it off the calling thread."""
        def init() -> None:
            try:
                import cupy

                with cupy.cuda.Device(self._device_index):
                    comm = _new_communicator(unique_id, pair.rank)
                if pair.aborted or pair.error is not None:
                    comm.abort()  # given up on while joining
                    return
                pair.comm = comm
            except Exception as exc:
                pair.error = f"init failed: {exc}"
            finally:
                pair.ready.set()

        threading.Thread(target=init, name=f"kv-nccl-init-{pair.peer_address}", daemon=True).start()

    def _live_pair(self, direction: str, peer_address: str) -> _Pair:
        with self._lock:
            pair = self._pairs.get((direction, peer_address))
        if pair is None or pair.comm is None or pair.aborted:
            raise KVTransferError(f"NCCL pair with {peer_address} is not open")
        return pair

    def _wait(self, pair: _Pair, event: torch.cuda.Event, deadline: float) -> None:
        while not event.query():
            if pair.aborted or pair.error is not None:
                raise KVTransferError(f"NCCL pair with {pair.peer_address} failed: {pair.error}")
            if time.monotonic() > deadline:
                raise KVTransferError(f"NCCL transfer with {pair.peer_address} timed out")
            time.sleep(0.0002)

    def _abort_pair(self, pair: _Pair) -> None:
        if pair.aborted:
            return
        pair.aborted = True
        if pair.watcher is not None:
            pair.watcher.stop()
        pair.error = pair.error or "aborted"
        pair.ready.set()  # a sender waiting for it to join (its peer may be gone) fails now
        if pair.comm is not None:
            try:
                pair.comm.abort()
            except Exception as exc:  # abort is best effort; the pair is dropped either way
                logger.warning("NCCL abort of pair with %s failed: %s", pair.peer_address, exc)

    def _watch(self) -> None:
        """Abort pairs whose outstanding call passed its deadline or reported an async error."""
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            with self._lock:
                pairs = list(self._pairs.items())
            for key, pair in pairs:
                late = pair.op_deadline is not None and now > pair.op_deadline
                failed = False
                if pair.comm is not None and not pair.aborted:
                    try:
                        pair.comm.check_async_error()
                    except Exception as exc:
                        pair.error, failed = f"async error: {exc}", True
                if late or failed:
                    logger.warning("aborting NCCL pair %s: %s", key, "deadline" if late else pair.error)
                    with self._lock:
                        if self._pairs.get(key) is pair:
                            del self._pairs[key]
                    self._abort_pair(pair)
