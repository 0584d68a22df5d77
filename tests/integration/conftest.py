"""Fixtures shared by the CPU cluster modules, made once a session (a server start costs
seconds of CPU on two cores)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.cluster_harness import (
    Cluster,
    Reference,
    build_tiny_checkpoint,
    colocated_answers,
    mixed_requests,
)

REFERENCE_REQUESTS = 64  # the most any module compares


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The tiny checkpoint and one colocated server's answers to ``mixed_requests(64)``."""
    root = tmp_path_factory.mktemp("reference")
    checkpoint = build_tiny_checkpoint(root / "ckpt")
    return Reference(checkpoint, colocated_answers(
        checkpoint, mixed_requests(REFERENCE_REQUESTS), root / "serve.log"))


@pytest.fixture(scope="session")
def plain_1p1d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One 1P1D cluster of the tiny checkpoint with the harness's defaults, for the modules
    that only send it requests and read its counters as differences (batches, structured
    outputs)."""
    root = tmp_path_factory.mktemp("plain-1p1d")
    cluster = Cluster.build(root / "logs", build_tiny_checkpoint(root / "ckpt"),
                            num_prefill=1, num_decode=1)
    try:
        cluster.start([cluster.proxy, *cluster.workers])
        cluster.wait_ready(cluster.workers)
        yield cluster
    finally:
        cluster.stop()
