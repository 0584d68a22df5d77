"""Routes between tensor-parallel layouts on real devices: producer ranks on cuda:0 and
cuda:1 send their KV heads to consumer ranks (CPU transport, so ranks may share a GPU),
head slices gathered and scattered on CUDA. Run on the GPU machine:
``source .device/env.sh && python3 -m pytest -m gpu tests/connectors/test_layout_routes_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from tests.connectors.layout_cluster import LayoutCluster

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("p_devices", "d_devices"), [
    (["cuda:0", "cuda:1"], ["cuda:0"]),  # P TP=2 on both GPUs -> D TP=1 on one of them
    (["cuda:0"], ["cuda:0", "cuda:1"]),  # P TP=1 -> D TP=2
    (["cuda:0", "cuda:1"], ["cuda:1", "cuda:0"]),  # TP=2 -> TP=2, ranks crossing GPUs
])
def test_routes_between_layouts_on_two_gpus(p_devices: list[str], d_devices: list[str]):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs, {torch.cuda.device_count()} present")
    cluster = LayoutCluster(len(p_devices), len(d_devices), p_devices, d_devices)
    try:
        for index in range(20):  # pushed and deferred sends alike
            cluster.d_caches_reset()
            outcomes = cluster.send(f"req-{index}", pull_first=index % 2 == 0)
            assert set(outcomes.values()) == {"ok"}, outcomes
            cluster.assert_landed()
        assert cluster.idle()
    finally:
        cluster.shutdown()
