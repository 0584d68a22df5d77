"""Defaults that must hold together across the proxy and the workers."""

from __future__ import annotations

from engine_core.config import KVTransferConfig
from proxy.config import ProxyConfig


def test_a_decode_worker_gives_up_a_dead_prefill_before_the_proxy_gives_up_the_stream() -> None:
    # A decode worker whose prefill worker died waits its transfer timeout, then computes the
    # prompt itself; that must start while the proxy still waits for the stream's first byte.
    assert KVTransferConfig().transfer_timeout_s < ProxyConfig().first_byte_deadline_s / 1.5
