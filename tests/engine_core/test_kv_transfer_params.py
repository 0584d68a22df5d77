"""``kv_transfer_params`` as typed values: the wire form round trips, and every bad value is
refused where it arrives (an InvalidRequestError, a 400, at the HTTP edge; a dropped message
on the engine socket), never a KeyError or a failed encoding deeper in."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from engine_core.cluster.trust import ClusterSecret
from engine_core.codec import PROTOCOL_VERSION, MessageCodec
from engine_core.config import EngineConfig, KVTransferConfig
from engine_core.errors import InvalidRequestError, MessageDecodeError
from engine_core.kv_transfer_params import KVTransferParams, KVTransferResult
from engine_core.messages import (
    ENGINE_INPUT_CODEC,
    ENGINE_OUTPUT_CODEC,
    AddRequest,
    EngineOutput,
    EngineOutputs,
)
from engine_core.parallel.kv_layout import KVLayout, PeerRanks
from engine_core.request_limits import MAX_CHOICES

PREFILL_LEG = {"transfer_id": "t1", "do_remote_decode": True, "remote_kv_address": "d:1",
               "grant": "g1.x.y", "first_token_events": True}
DECODE_LEG = {"transfer_id": "t1", "do_remote_prefill": True, "remote_kv_address": "p:1",
              "grant": "g1.x.y", "generated_token_ids": [[42], []], "stream_token_ids": True}
# One prompt's logprobs from P (positions 1 and 2, k = 1), and a one-token prompt's (none).
SCORED = {"token_ids": [5, 6], "logprobs": [-1.5, -0.25], "ranks": [2, 1],
          "top_token_ids": [[7], [6]], "top_logprobs": [[-0.5], [-0.25]]}
UNSCORED = {"token_ids": [], "logprobs": [], "ranks": [], "top_token_ids": [],
            "top_logprobs": []}


@pytest.mark.parametrize("wire", [PREFILL_LEG, DECODE_LEG, {"stream_token_ids": True},
                                  {"generated_token_ids": [[100, 101]]}, {},
                                  {**DECODE_LEG, "prompt_logprobs": [SCORED, UNSCORED]}])
def test_wire_form_round_trips(wire: dict[str, Any]) -> None:
    params = KVTransferParams.from_wire(wire)
    assert params.to_wire() == wire
    assert KVTransferParams.from_wire(params.to_wire()) == params


def test_fields_read_as_attributes() -> None:
    decode = KVTransferParams.from_wire(DECODE_LEG)
    assert decode.do_remote_prefill and not decode.do_remote_decode and decode.moves_kv
    assert decode.generated_token_ids == ((42,), ())
    assert (decode.transfer_id, decode.remote_kv_address) == ("t1", "p:1")
    assert not decode.without_kv_transfer().moves_kv
    assert decode.without_kv_transfer().generated_token_ids == ((42,), ())
    scored = KVTransferParams.from_wire({"prompt_logprobs": [{**SCORED, "logprobs": [-1, 0]}]})
    (columns,) = scored.prompt_logprobs
    assert columns.logprobs == (-1.0, 0.0) and columns.top_token_ids == ((7,), (6,))
    assert columns.num_top == 1


def test_nulls_count_as_absent_and_unknown_keys_are_ignored() -> None:
    """vLLM's proxies send their own connectors' keys (null when unused)."""
    wire = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "grant": None}
    assert KVTransferParams.from_wire(wire) == KVTransferParams(do_remote_decode=True)


REFUSED = {
    "not an object": ["x"],
    "flag not a boolean": {"do_remote_decode": 1},
    "first_token_events not a boolean": {"first_token_events": "yes"},
    "stream_token_ids not a boolean": {"stream_token_ids": 0},
    "transfer id not a string": {"transfer_id": 7},
    "empty transfer id": {"transfer_id": ""},
    "transfer id too long": {"transfer_id": "t" * 1025},
    "unprintable transfer id": {"transfer_id": "t\n1"},
    "grant not a string": {"grant": ["g1"]},
    "grant too long": {"grant": "g" * 4097},
    "address without a port": {"remote_kv_address": "host"},
    "address not a string": {"remote_kv_address": 1},
    "generated not a list": {"generated_token_ids": "7"},
    "generated flat": {"generated_token_ids": [1]},
    "generated names no choice": {"generated_token_ids": []},
    "generated negative": {"generated_token_ids": [[-1]]},
    "generated boolean": {"generated_token_ids": [[True]]},
    "generated float": {"generated_token_ids": [[1.0]]},
    "generated too many choices": {"generated_token_ids": [[1]] * (MAX_CHOICES + 1)},
    "first events and continuation": {"first_token_events": True,
                                      "generated_token_ids": [[1]]},
    "prompt logprobs not a list": {"prompt_logprobs": SCORED},
    "prompt logprobs name no prompt": {"prompt_logprobs": []},
    "prompt logprobs entry not an object": {"prompt_logprobs": [[1]]},
    "prompt logprobs column missing": {"prompt_logprobs": [{**SCORED, "ranks": None}]},
    "prompt logprobs columns of two lengths": {"prompt_logprobs": [{**SCORED, "ranks": [1]}]},
    "prompt logprob positive": {"prompt_logprobs": [{**SCORED, "logprobs": [-1.0, 0.5]}]},
    "prompt logprob not a number": {"prompt_logprobs": [{**SCORED, "logprobs": ["-1", -1]}]},
    "prompt logprob rank 0": {"prompt_logprobs": [{**SCORED, "ranks": [0, 1]}]},
    "prompt logprob token negative": {"prompt_logprobs": [{**SCORED, "token_ids": [-5, 6]}]},
    "prompt logprob top rows of two sizes": {"prompt_logprobs": [
        {**SCORED, "top_token_ids": [[7], [6, 8]], "top_logprobs": [[-0.5], [-0.25, -3.0]]}]},
    "prompt logprob top ids and values differ": {"prompt_logprobs": [
        {**SCORED, "top_logprobs": [[-0.5, -1.0], [-0.25]]}]},
    "prompt logprob top row not a list": {"prompt_logprobs": [
        {**SCORED, "top_token_ids": [7, 6]}]},
    "prompt logprob too many top": {"prompt_logprobs": [
        {**SCORED, "top_token_ids": [[7] * 21, [6] * 21],
         "top_logprobs": [[-0.5] * 21, [-0.25] * 21]}]},
    "lone surrogate in an ignored key": {"x": "\ud800"},
    "integer past 64 bits": {"x": 1 << 64},
    "nested too deep": {"x": [[[[[[[[[[1]]]]]]]]]]},
    "non-string key": {1: True},
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_bad_values_are_invalid_requests(name: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        KVTransferParams.from_wire(REFUSED[name])
    assert info.value.param == "kv_transfer_params"


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(InvalidRequestError, match="remote_kv_address"):
        KVTransferParams(do_remote_prefill=True, remote_kv_address="nowhere")
    with pytest.raises(InvalidRequestError, match="generated_token_ids"):
        KVTransferParams(generated_token_ids=([1],))  # type: ignore[arg-type]


def _add_request(params: dict[str, Any]) -> bytes:
    return msgpack.packb({"t": "AddRequest", "v": PROTOCOL_VERSION, "d": {
        "request_id": "r1", "prompt_token_ids": [1, 2], "sampling_params": {},
        "arrival_time": 0.0, "kv_transfer_params": params}}, use_bin_type=True)


@pytest.mark.parametrize("address", ["x y:1", "h/x:1", "*:1", "h:0", "h:99999", ""])
def test_a_bad_peer_address_is_refused_not_fatal(address: str) -> None:
    """An address a socket cannot connect to is refused where it arrives: a 400 at the HTTP
    edge, a dropped (counted) message on the engine socket; no connector ever dials it."""
    wire = {"do_remote_prefill": True, "transfer_id": "t1", "remote_kv_address": address}
    with pytest.raises(InvalidRequestError, match="remote_kv_address"):
        KVTransferParams.from_wire(wire)
    with pytest.raises(MessageDecodeError):
        ENGINE_INPUT_CODEC.decode(_add_request(wire))


def test_engine_messages_carry_the_typed_values() -> None:
    params = KVTransferParams.from_wire(DECODE_LEG)
    message = AddRequest("r1", [1, 2], {}, 0.0, params, [42])
    assert ENGINE_INPUT_CODEC.decode(ENGINE_INPUT_CODEC.encode(message)) == message
    result = KVTransferResult("t1", "p:1", 3)
    outputs = EngineOutputs([EngineOutput("r1", [5], 2, 0, "length", kv_transfer_params=result)])
    (output,) = ENGINE_OUTPUT_CODEC.decode(ENGINE_OUTPUT_CODEC.encode(outputs)).outputs
    assert output.kv_transfer_params == result
    assert result.to_wire() == {"transfer_id": "t1", "remote_kv_address": "p:1",
                                "num_kv_blocks": 3}


def test_the_engine_socket_refuses_unknown_param_fields() -> None:
    with pytest.raises(MessageDecodeError, match="kv_transfer_params"):
        ENGINE_INPUT_CODEC.decode(_add_request({"do_remote_prefill": True, "x": 1}))


def test_remote_ranks_are_typed_and_checked_once() -> None:
    ranks = PeerRanks(KVLayout.of_rank(2, 0, 2, 8, 16, "float32", 2), ("p:1", "p:2"))
    wire = {**DECODE_LEG, "remote_ranks": ranks.to_wire()}
    params = KVTransferParams.from_wire(wire)
    assert params.remote_ranks == ranks
    assert params.to_wire()["remote_ranks"] == ranks.to_wire()
    message = AddRequest("r1", [1, 2], {}, 0.0, params, [])
    assert ENGINE_INPUT_CODEC.decode(ENGINE_INPUT_CODEC.encode(message)) == message
    bad = ranks.to_wire()
    bad["addresses"] = ["p:1"]  # one address for two ranks
    with pytest.raises(InvalidRequestError, match="remote_ranks"):
        KVTransferParams.from_wire({**DECODE_LEG, "remote_ranks": bad})


def test_a_cluster_secret_never_crosses_a_socket() -> None:
    config = EngineConfig.from_kwargs("m").with_changes(kv_transfer=KVTransferConfig(
        cluster_secret=ClusterSecret(b"s" * 32)))
    codec = MessageCodec([EngineConfig])
    payload = codec.encode(config)
    assert b"s" * 32 not in payload
    assert codec.decode(payload).kv_transfer.cluster_secret == ClusterSecret()
