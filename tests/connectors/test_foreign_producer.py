"""A header or abort for a load from a producer the consumer did not pull from is refused,
and the load still completes from its own producer (CPU transport).

Before, the consumer accepted any producer's header: another sender's bytes landed in the
request's blocks and were reported as its KV, and the real producer's header was refused.
"""

from __future__ import annotations

import numpy as np

from connectors.p2p_nccl.handshake import ControlClient
from connectors.p2p_nccl.messages import KVLayerData, KVSendAbort, KVSendHeader, make_codec
from tests.connectors.worker_pair import BLOCK_SHAPE, DST, LAYERS, WorkerPair, wait_until


def test_foreign_header_and_abort_are_refused() -> None:
    pair = WorkerPair(nccl=False, timeout_s=3.0)
    consumer = pair.consumer
    assert consumer is not None
    stranger = ControlClient(pair.d_addr, make_codec(), send_timeout_s=1.0)
    try:
        pair.ask("t")  # the consumer pulled "t" from pair.p_addr
        other = "127.0.0.1:1"
        stranger.send(KVSendAbort("t", other, "not yours"))
        stranger.send(KVSendHeader("t", other, "e1", 1, 0, len(DST), LAYERS, "float32",
                                   list(BLOCK_SHAPE), LAYERS))
        nbytes = LAYERS * 2 * len(DST) * int(np.prod(BLOCK_SHAPE)) * 4
        stranger.send(KVLayerData("t", "e1", 1, 0, nbytes), [bytes(nbytes)])
        assert wait_until(lambda: consumer.stats()["messages_rejected"] >= 3, 3.0)
        assert consumer.land_loads().recving == set()  # nothing landed from the stranger
        pair.compute("t")
        assert pair.outcome("t") == "ok"  # bit for bit from its own producer
        assert pair.idle()
    finally:
        stranger.close()
        pair.shutdown()
