"""The NCCL transport's watchdog deadline of a receiving pair, on CPU with fakes for the
CUDA events, the stream and the communicator: only the landing of the latest posted
receives may clear it. Before, an earlier load landing (polled by the engine thread, even
while the control thread was posting the next load) left the next one's receives unwatched.
"""

from __future__ import annotations

import contextlib
import threading
import types
from typing import Any

import pytest
import torch

from connectors.p2p_nccl import transport as tr


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.done = False

    def record(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _Comm:
    """``recv`` runs ``during_recv`` once: what another thread does mid-post."""

    def __init__(self) -> None:
        self.during_recv: Any = None

    def recv(self, *args: Any) -> None:
        if self.during_recv is not None:
            hook, self.during_recv = self.during_recv, None
            hook()


@pytest.fixture
def receiving_pair(monkeypatch: pytest.MonkeyPatch) -> Any:
    events: list[_Event] = []

    def make_event(*args: Any, **kwargs: Any) -> _Event:
        events.append(_Event())
        return events[-1]

    monkeypatch.setattr(torch.cuda, "Event", make_event)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(tr, "_nccl", lambda: types.SimpleNamespace(NCCL_UINT8=0))
    transport = object.__new__(tr.NcclPairTransport)  # no watchdog thread, no CUDA
    transport._pairs, transport._lock = {}, threading.Lock()
    transport.data_calls, transport.recv_gpu_seconds = 0, 0.0
    pair = tr._Pair("p:1", 1, types.SimpleNamespace(wait_event=lambda e: None, cuda_stream=0))
    pair.comm = _Comm()
    pair.ready.set()
    transport._pairs[("recv", "p:1")] = pair
    buffer = types.SimpleNamespace(record_stream=lambda s: None, data_ptr=lambda: 0,
                                   numel=lambda: 4, element_size=lambda: 1)
    return transport, pair, buffer, events


def test_an_earlier_landing_does_not_unwatch_later_receives(receiving_pair: Any) -> None:
    transport, pair, buffer, events = receiving_pair
    first = transport.post_recv("p:1", [buffer])
    first_done = events[-1]
    second = transport.post_recv("p:1", [buffer])
    first_done.done = True
    assert first.poll()
    assert pair.op_deadline is not None  # the second load's receives are still outstanding
    events[-1].done = True
    assert second.poll()
    assert pair.op_deadline is None


def test_a_landing_polled_mid_post_does_not_unwatch_that_post(receiving_pair: Any) -> None:
    transport, pair, buffer, events = receiving_pair
    first = transport.post_recv("p:1", [buffer])
    first_done = events[-1]

    def engine_polls_the_first_load() -> None:
        first_done.done = True
        assert first.poll()

    pair.comm.during_recv = engine_polls_the_first_load
    second = transport.post_recv("p:1", [buffer])
    assert pair.op_deadline is not None
    events[-1].done = True
    assert second.poll() and pair.op_deadline is None
