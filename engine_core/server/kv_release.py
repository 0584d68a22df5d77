"""``POST /internal/kv/release``: its body, validated once at the edge.

A decode worker that refused a request tells the prefill worker holding its KV to drop it now
rather than at its lease's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine_core.addresses import is_host_port
from engine_core.cluster.grants import MAX_GRANT_CHARS, MAX_TRANSFER_ID_CHARS
from engine_core.errors import InvalidRequestError
from engine_core.kv_transfer_params import is_transfer_id
from engine_core.parallel.kv_layout import KVLayoutError, PeerRanks
from engine_core.request_limits import MAX_CHOICES

# /internal/kv/release: transfers one call may name (a request's prompts move one each).
MAX_RELEASES = MAX_CHOICES
_RELEASE_FIELDS = frozenset({"transfer_ids", "remote_kv_address", "grant", "remote_ranks"})
RELEASE_TOKEN = 0  # the one-token prompt of a release (any id of the vocabulary does)


@dataclass(frozen=True)
class KVRelease:
    """Transfers no decode leg will pull (this worker refused their request), whose KV the
    prefill worker at ``producer_address`` holds and is to drop now, not at its lease's end.
    ``grant`` is the transfers' grant (the proxy's, naming that worker and this one): the
    connector tells a producer nothing without it."""

    transfer_ids: list[str]
    producer_address: str
    grant: str = ""
    producer_ranks: PeerRanks | None = None  # its KV layout and rank addresses


def parse_kv_release(body: dict[str, Any]) -> KVRelease:
    """Validate a /internal/kv/release body: ``{"transfer_ids": [...], "remote_kv_address":
    "host:port", "grant": "..."}`` and nothing else."""
    unknown = sorted(set(body) - _RELEASE_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unsupported parameter(s): {', '.join(unknown)}", unknown[0])
    ids = body.get("transfer_ids")
    if (not isinstance(ids, list) or not 0 < len(ids) <= MAX_RELEASES
            or not all(is_transfer_id(t) for t in ids) or len(set(ids)) != len(ids)):
        raise InvalidRequestError(
            f"transfer_ids must be 1 to {MAX_RELEASES} distinct printable strings of at most "
            f"{MAX_TRANSFER_ID_CHARS} characters", "transfer_ids")
    address = body.get("remote_kv_address")
    if not is_host_port(address):
        raise InvalidRequestError("remote_kv_address must be host:port", "remote_kv_address")
    grant = body.get("grant", "")
    if not isinstance(grant, str) or len(grant) > MAX_GRANT_CHARS:
        raise InvalidRequestError(f"grant must be a string of at most {MAX_GRANT_CHARS} "
                                  "characters", "grant")
    ranks = body.get("remote_ranks")
    if ranks is not None:
        try:
            ranks = PeerRanks.from_wire(ranks)
        except KVLayoutError as exc:
            raise InvalidRequestError(f"remote_ranks: {exc}", "remote_ranks") from None
    return KVRelease(list(ids), address, grant, ranks)
