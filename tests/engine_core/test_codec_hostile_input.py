"""Hostile payloads on the engine's sockets: every one is a ``MessageDecodeError`` (counted and
dropped by the receiver), never another exception type that escapes it.

Two shapes used to escape: a union field (``kv_transfer_params: dict | None``, ``zmq_address:
str | None``, ...) holding a list nested ~1000 deep, whose ``repr`` in the error message raised
RecursionError, and unknown fields whose keys mix types (msgpack maps allow int keys), whose
``sorted`` raised TypeError. On the engine input either one killed the engine process."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import zmq

from connectors.p2p_nccl.messages import CONTROL_CODEC, WIRE_VERSION
from engine_core.cluster.messages import REGISTRATION_CODEC
from engine_core.codec import PROTOCOL_VERSION
from engine_core.engine_process import EngineCoreProc
from engine_core.errors import MessageDecodeError
from engine_core.messages import ENGINE_INPUT_CODEC, ENGINE_OUTPUT_CODEC

DEEP = 1000  # msgpack unpacks it; repr() of it exceeds the default recursion limit


def _deep_list(depth: int = DEEP) -> bytes:
    """msgpack bytes of ``[[[...[]...]]]`` nested ``depth`` deep (packb refuses to build it)."""
    return b"\x91" * depth + b"\x90"


def _envelope(name: str, body: dict[Any, Any], version: int = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb({"t": name, "v": version, "d": body}, use_bin_type=True)


def _with_deep(name: str, body: dict[str, Any], field: str, version: int = PROTOCOL_VERSION) -> bytes:
    """``body`` with ``field`` replaced by the deep list (spliced in at the ``None`` marker)."""
    payload = _envelope(name, {**body, field: None}, version)
    assert payload.count(b"\xc0") == 1
    return payload.replace(b"\xc0", _deep_list())


ADD = {"request_id": "r", "prompt_token_ids": [1, 2], "sampling_params": {}, "arrival_time": 0.0}
HEARTBEAT = {"role": "P", "http_address": "127.0.0.1:8000", "model": "m"}
OUTPUT = {"request_id": "r", "new_token_ids": [], "num_prompt_tokens": 1, "num_cached_tokens": 0}

HOSTILE = [
    ("engine input, deep union", ENGINE_INPUT_CODEC,
     _with_deep("AddRequest", ADD, "kv_transfer_params")),
    ("engine input, mixed unknown keys", ENGINE_INPUT_CODEC,
     _envelope("AddRequest", {**ADD, 1: 2, "x": 3})),
    ("engine output, deep union", ENGINE_OUTPUT_CODEC,
     _with_deep("UtilityResult", {"call_id": 1, "ok": False}, "error")),
    ("engine output, mixed unknown keys", ENGINE_OUTPUT_CODEC,
     _envelope("EngineOutputs", {"outputs": [{**OUTPUT, 7: 1, "y": 2}]})),
    ("registration, deep union", REGISTRATION_CODEC,
     _with_deep("Heartbeat", HEARTBEAT, "zmq_address")),
    ("registration, mixed unknown keys", REGISTRATION_CODEC,
     _envelope("Deregister", {"http_address": "h:1", 1: 1, "z": 1})),
    # The control codec inside the sealed envelope (``make_codec``), which opens first.
    ("kv control, mixed unknown keys", CONTROL_CODEC,
     _envelope("KVSendAbort", {"transfer_id": "t", "producer_address": "h:1", "reason": "r",
                               1: 2, "x": 3}, WIRE_VERSION)),
]


@pytest.mark.parametrize("what,codec,payload", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_payloads_are_decode_errors(what: str, codec: Any, payload: bytes) -> None:
    with pytest.raises(MessageDecodeError) as info:
        codec.decode(payload)
    assert len(str(info.value)) < 400  # described, not dumped


def test_union_mismatch_message_is_bounded() -> None:
    """A 1 MB value that fits no branch of a union is described in a few characters."""
    payload = _envelope("AddRequest", {**ADD, "kv_transfer_params": "x" * (1 << 20)})
    with pytest.raises(MessageDecodeError, match="kv_transfer_params") as info:
        ENGINE_INPUT_CODEC.decode(payload)
    assert len(str(info.value)) < 400


class _IdleEngine:
    """Just enough of an EngineCore for the loop's message handling."""

    def __init__(self) -> None:
        self.added: list[Any] = []

    def doorbell(self) -> None:
        return None

    def add_request(self, message: Any) -> None:
        self.added.append(message)


def test_engine_loop_counts_hostile_inputs_and_goes_on() -> None:
    """The engine-core loop drops and counts each hostile input; a good one still runs."""
    context = zmq.Context()
    inputs, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    try:
        engine = _IdleEngine()
        proc = EngineCoreProc(engine, inputs, outputs)  # type: ignore[arg-type]
        hostile = [payload for _, codec, payload in HOSTILE if codec is ENGINE_INPUT_CODEC]
        for payload in hostile:
            proc._handle(payload)
        assert proc.num_rejected_messages == len(hostile)
        proc._handle(_envelope("AddRequest", ADD))
        assert [m.request_id for m in engine.added] == ["r"]
    finally:
        inputs.close(0)
        outputs.close(0)
        context.term()


class _SleepingEngine(_IdleEngine):
    def add_request(self, message: Any) -> None:
        from engine_core.errors import EngineSleepingError

        raise EngineSleepingError("the engine is asleep")


def test_a_request_refused_while_asleep_logs_no_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    """A request that reaches a sleeping engine ends with an error output (the client gets
    a 503) and one log line; every such request logged a traceback before."""
    import logging

    context = zmq.Context()
    inputs, outputs, sink = (context.socket(zmq.PULL), context.socket(zmq.PUSH),
                             context.socket(zmq.PULL))
    sink.bind("inproc://outputs")
    outputs.connect("inproc://outputs")  # the error output needs a peer to go to
    try:
        proc = EngineCoreProc(_SleepingEngine(), inputs, outputs)  # type: ignore[arg-type]
        with caplog.at_level(logging.INFO):
            proc._handle(_envelope("AddRequest", ADD))
        assert sink.poll(5000), "no error output"
        mine = [r for r in caplog.records if "request r" in r.getMessage()]
        assert len(mine) == 1 and mine[0].exc_info is None, mine
    finally:
        for socket in (inputs, outputs, sink):
            socket.close(0)
        context.term()
