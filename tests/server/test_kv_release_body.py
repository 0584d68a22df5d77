"""``/internal/kv/release`` bodies: validated once at the edge, the producer's ranks typed."""

from __future__ import annotations

import pytest

from engine_core.errors import InvalidRequestError
from engine_core.parallel.kv_layout import KVLayout, PeerRanks
from engine_core.server.kv_release import KVRelease, parse_kv_release


def test_a_release_may_name_the_producers_ranks() -> None:
    ranks = PeerRanks(KVLayout.of_rank(2, 0, 2, 8, 16, "float32", 2), ("p:1", "p:2"))
    body = {"transfer_ids": ["t"], "remote_kv_address": "p:1", "grant": "g",
            "remote_ranks": ranks.to_wire()}
    assert parse_kv_release(body) == KVRelease(["t"], "p:1", "g", ranks)
    with pytest.raises(InvalidRequestError, match="remote_ranks"):
        parse_kv_release({**body, "remote_ranks": {"layout": {}, "addresses": []}})
