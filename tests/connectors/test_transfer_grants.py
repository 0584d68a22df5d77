"""KV moves only under the proxy's grant: the scheduler sides of P and D (pure, ms)."""

from __future__ import annotations

from typing import Any

import pytest

from connectors.p2p_nccl.scheduler_side import P2pConnectorScheduler
from engine_core.cluster.grants import GrantAuthority
from engine_core.cluster.trust import ClusterSecret
from engine_core.config import KVTransferConfig
from engine_core.kv_transfer_params import KVTransferParams
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.outputs import NewRequestData, SchedulerOutput

BS = 4
SECRET = ClusterSecret(b"0123456789abcdef0123456789abcdef")
OWN = "127.0.0.1:14579"  # KVTransferConfig's default kv_ip:kv_port
PEER, ATTACKER = "10.0.0.2:14580", "10.6.6.6:14580"
PROXY = GrantAuthority(SECRET)


def sched(role: str) -> P2pConnectorScheduler:
    return P2pConnectorScheduler(KVTransferConfig(kv_role=role, cluster_secret=SECRET), BS)


def request(flag: str, grant: Any, transfer_id: str = "T", peer: str = PEER,
            request_id: str = "r") -> Request:
    params = {"transfer_id": transfer_id, flag: True, "remote_kv_address": peer}
    if grant is not None:
        params["grant"] = grant
    return Request(request_id=request_id, prompt_token_ids=list(range(3 * BS + 1)),
                   sampling_params=SamplingParams(max_tokens=1),
                   kv_transfer_params=KVTransferParams.from_wire(params))


def saves_of(producer: P2pConnectorScheduler, req: Request) -> list:
    producer.get_num_new_matched_tokens(req, 0)
    new = NewRequestData(req.request_id, req.prompt_token_ids, req.num_prompt_tokens,
                         req.sampling_params, [1, 2, 3, 4], 0)
    out = SchedulerOutput([new], [], {req.request_id: req.num_prompt_tokens},
                          req.num_prompt_tokens)
    return producer.build_connector_meta(out).saves


REFUSED_GRANTS = {
    "missing": None,
    "forged": GrantAuthority(ClusterSecret(b"x" * 32)).issue("T", OWN, PEER, 60.0),
    "unkeyed": GrantAuthority(ClusterSecret()).issue("T", OWN, PEER, 60.0),
    "expired": PROXY.issue("T", OWN, PEER, -60.0),
    "other transfer": PROXY.issue("U", OWN, PEER, 60.0),
}


def test_producer_sends_to_the_granted_consumer():
    producer = sched("kv_producer")
    (save,) = saves_of(producer, request("do_remote_decode", PROXY.issue("T", OWN, PEER, 60.0)))
    assert save.peer_address == PEER
    assert producer.stats()["transfer_grants_refused"] == 0


@pytest.mark.parametrize("name", sorted(REFUSED_GRANTS))
def test_producer_without_a_valid_grant_sends_nothing(name):
    producer = sched("kv_producer")
    req = request("do_remote_decode", REFUSED_GRANTS[name])
    assert saves_of(producer, req) == []
    hold, _ = producer.request_finished(req, [1, 2, 3, 4])
    assert not hold and producer.is_idle()
    assert producer.stats()["invalid_transfer_params"] == 1
    assert producer.stats()["transfer_grants_refused"] == 1


def test_producer_refuses_params_that_name_another_consumer_than_the_grant():
    """An HTTP client writing its own kv_transfer_params cannot point P at itself."""
    producer = sched("kv_producer")
    grant = PROXY.issue("T", OWN, PEER, 60.0)
    assert saves_of(producer, request("do_remote_decode", grant, peer=ATTACKER)) == []
    assert producer.stats()["transfer_grants_refused"] == 1


def test_consumer_pulls_only_from_the_granted_producer():
    consumer = sched("kv_consumer")
    granted = request("do_remote_prefill", PROXY.issue("T", PEER, OWN, 60.0))
    assert consumer.get_num_new_matched_tokens(granted, 0).num_tokens == 3 * BS
    stranger = request("do_remote_prefill", PROXY.issue("T", PEER, OWN, 60.0), peer=ATTACKER,
                       request_id="s")
    match = consumer.get_num_new_matched_tokens(stranger, 0)
    assert (match.num_tokens, match.is_async) == (0, False)  # computed locally
    consumer.request_finished(stranger, [])
    assert consumer.stats()["transfer_grants_refused"] == 1


@pytest.mark.parametrize("name", sorted(REFUSED_GRANTS))
def test_consumer_without_a_valid_grant_computes_locally_and_tells_no_one(name):
    consumer = sched("kv_consumer")
    grant = REFUSED_GRANTS[name]
    if name != "missing":  # the consumer-side view of the same refused grants
        grant = {"forged": GrantAuthority(ClusterSecret(b"x" * 32)).issue("T", PEER, OWN, 60.0),
                 "unkeyed": GrantAuthority(ClusterSecret()).issue("T", PEER, OWN, 60.0),
                 "expired": PROXY.issue("T", PEER, OWN, -60.0),
                 "other transfer": PROXY.issue("U", PEER, OWN, 60.0)}[name]
    req = request("do_remote_prefill", grant)
    assert consumer.get_num_new_matched_tokens(req, 0).num_tokens == 0
    assert consumer.request_finished(req, []) == (False, None)
    out = SchedulerOutput([], [], {}, 0)
    assert consumer.build_connector_meta(out).is_empty  # no release sent to the named peer
    assert consumer.is_idle()


def test_a_grant_is_checked_once_however_long_the_request_waits():
    consumer = sched("kv_consumer")
    clock = [1000.0]
    consumer._grants = GrantAuthority(SECRET, clock=lambda: clock[0], leeway_s=0.0)
    proxy = GrantAuthority(SECRET, clock=lambda: clock[0])
    req = request("do_remote_prefill", proxy.issue("T", PEER, OWN, 10.0))
    assert consumer.get_num_new_matched_tokens(req, 0).num_tokens == 3 * BS
    clock[0] += 60.0  # queued past the grant's expiry: admitted already, it still loads
    assert consumer.get_num_new_matched_tokens(req, 0).num_tokens == 3 * BS


def test_batch_prompts_move_under_their_requests_grant():
    producer = sched("kv_producer")
    grant = PROXY.issue("T", OWN, PEER, 60.0)
    (save,) = saves_of(producer, request("do_remote_decode", grant, transfer_id="T-p2"))
    assert save.transfer_id == "T-p2"
