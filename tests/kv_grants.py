"""Transfer grants for tests that write ``kv_transfer_params`` themselves, as the proxy
would attach them (no cluster secret, as the tests' engines)."""

from __future__ import annotations

from typing import Any

from engine_core.cluster.grants import GrantAuthority
from engine_core.cluster.trust import ClusterSecret
from engine_core.kv_transfer_params import KVTransferParams


def granted(params: dict[str, Any], own_address: str, ttl_s: float = 3600.0) -> dict[str, Any]:
    """``params`` (a ``do_remote_prefill`` or ``do_remote_decode`` leg) plus the grant naming
    the engine at ``own_address`` and the params' ``remote_kv_address``."""
    peer = params["remote_kv_address"]
    producer, consumer = ((peer, own_address) if params.get("do_remote_prefill")
                          else (own_address, peer))
    grant = GrantAuthority(ClusterSecret()).issue(params["transfer_id"], producer, consumer, ttl_s)
    return {**params, "grant": grant}


def granted_params(params: dict[str, Any], own_address: str,
                   ttl_s: float = 3600.0) -> KVTransferParams:
    """``granted``, as the typed params an engine request carries."""
    return KVTransferParams.from_wire(granted(params, own_address, ttl_s))


def transfer_grant(transfer_id: str, producer: str, consumer: str, ttl_s: float = 3600.0) -> str:
    """The grant of ``transfer_id`` from ``producer`` to ``consumer`` (KV addresses), for a
    test that builds a ``LoadSpec`` or a pull itself."""
    return GrantAuthority(ClusterSecret()).issue(transfer_id, producer, consumer, ttl_s)
