"""Fixtures shared by the CPU cluster modules, made once a session (a server start costs
seconds of CPU on two cores)."""

from __future__ import annotations

import pytest

from tests.integration.cluster_harness import (
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
