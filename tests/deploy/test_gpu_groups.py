"""`pdserve launch` tensor-parallel GPU groups, per-kind sizes, and the KV port runs of
tensor-parallel workers with a KV connector (rank r at kv_port + r)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import build_parser
from deploy.gpu_groups import gpu_groups
from deploy.launch import build_children, engine_argv, free_port_runs

# Launch plans for GPUs that no CUDA_VISIBLE_DEVICES of the machine running them narrows.
pytestmark = pytest.mark.usefixtures("no_cuda_visible_devices")


def _parse(*argv: str):
    return build_parser().parse_args(["launch", "--model", "/m", *argv])


def _tp_of(argv: list[str]) -> str:
    """The value the worker's parser keeps: the last --tensor-parallel-size."""
    index = len(argv) - 1 - argv[::-1].index("--tensor-parallel-size")
    return argv[index + 1]


def test_colocated_workers_take_consecutive_gpu_groups(tmp_path: Path) -> None:
    args = _parse("--prefill", "0", "--decode", "0", "--colocated", "2", "-tp", "2",
                  "--gpus", "0,1,2,3")
    _, workers, _ = build_children(args, engine_argv(args), tmp_path)
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0,1", "2,3"]
    assert [_tp_of(w.argv) for w in workers] == ["2", "2"]
    # launch sets each worker's size itself: the user's -tp is not forwarded as well
    assert all(w.argv.count("--tensor-parallel-size") == 1 for w in workers)


def test_per_role_sizes_and_cpu_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(8)))
    args = _parse("--prefill", "1", "--decode", "1", "--colocated", "1", "--colocated-tp", "2",
                  "--gpus", "")
    monkeypatch.setattr("deploy.launch.detect_gpus", lambda _spec, _visible: [])
    _, workers, _ = build_children(args, engine_argv(args), tmp_path)
    assert [_tp_of(w.argv) for w in workers] == ["1", "1", "2"]
    assert {w.env["OMP_NUM_THREADS"] for w in workers} == {"2"}  # 8 cores over 4 ranks


def test_too_few_gpus_for_the_groups_is_a_clear_error() -> None:
    assert gpu_groups(["4", "5", "6"], [1, 2]) == ["4", "5,6"]
    with pytest.raises(SystemExit, match=r"need 4 GPUs"):
        gpu_groups(["0", "1", "2"], [2, 2])


def test_pd_workers_of_different_sizes_get_their_groups_and_kv_port_runs(
        tmp_path: Path) -> None:
    args = _parse("--prefill", "1", "--decode", "2", "--prefill-tp", "2", "--gpus", "0,1,2,3")
    _, workers, _ = build_children(args, engine_argv(args), tmp_path)
    assert [w.name for w in workers] == ["prefill0", "decode0", "decode1"]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0,1", "2", "3"]
    assert [_tp_of(w.argv) for w in workers] == ["2", "1", "1"]
    kv_ports = [json.loads(w.argv[w.argv.index("--kv-transfer-config") + 1])["kv_port"]
                for w in workers]
    http_ports = [int(w.http_address.rpartition(":")[2]) for w in workers]
    # The prefill worker's rank 1 listens at kv_port + 1: no other socket may take it.
    taken = [kv_ports[0], kv_ports[0] + 1, *kv_ports[1:], *http_ports, args.port]
    assert len(set(taken)) == len(taken)


def test_port_runs_are_consecutive_and_disjoint() -> None:
    firsts = free_port_runs([3, 1, 2])
    ports = [first + offset for first, length in zip(firsts, [3, 1, 2]) for offset
             in range(length)]
    assert len(set(ports)) == len(ports) == 6


def test_placed_workers_take_one_gpu_and_colocated_their_group(tmp_path: Path) -> None:
    args = _parse("--workers", "2", "--colocated", "1", "--colocated-tp", "2",
                  "--gpus", "0,1,2,3")
    _, workers, _ = build_children(args, engine_argv(args), tmp_path)
    assert [w.name for w in workers] == ["worker0", "worker1", "colocated0"]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0", "1", "2,3"]
    assert [_tp_of(w.argv) for w in workers] == ["1", "1", "2"]


def test_gpus_count_the_visible_ones() -> None:
    from deploy.gpu_groups import detect_gpus

    assert detect_gpus("0,1,1", "2,3") == ["2", "3", "3"]
    assert detect_gpus(None, "2,3") == ["2", "3"]
    with pytest.raises(SystemExit, match="beyond"):
        detect_gpus("0,2", "2,3")
    assert detect_gpus("4,5", None) == ["4", "5"]


class _FakeNvml:
    """libnvidia-ml's three calls the launcher makes, with chosen return codes."""

    def __init__(self, count: int, init_rc: int = 0, count_rc: int = 0) -> None:
        self.count, self.init_rc, self.count_rc = count, init_rc, count_rc
        self.shut_down = False

    def nvmlInit_v2(self) -> int:
        return self.init_rc

    def nvmlDeviceGetCount_v2(self, ref) -> int:
        ref._obj.value = self.count
        return self.count_rc

    def nvmlShutdown(self) -> int:
        self.shut_down = True
        return 0


def test_the_device_count_comes_from_nvml_without_torch(monkeypatch) -> None:
    """Three GPUs from the driver's library (torch never asked); no library, no GPU; a
    library that fails falls back to torch's count."""
    import deploy.gpu_groups as gpu_groups

    monkeypatch.setattr(gpu_groups, "_torch_device_count", lambda: 7)
    nvml = _FakeNvml(3)
    monkeypatch.setattr(gpu_groups.ctypes, "CDLL", lambda name: nvml)
    assert gpu_groups.detect_gpus(None, None) == ["0", "1", "2"] and nvml.shut_down
    monkeypatch.setattr(gpu_groups.ctypes, "CDLL", lambda name: _FakeNvml(3, init_rc=9))
    assert gpu_groups.device_count() == 7
    failing = _FakeNvml(3, count_rc=9)
    monkeypatch.setattr(gpu_groups.ctypes, "CDLL", lambda name: failing)
    assert gpu_groups.device_count() == 7 and failing.shut_down

    def no_library(name: str):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(gpu_groups.ctypes, "CDLL", no_library)
    assert gpu_groups.device_count() == 0 and gpu_groups.detect_gpus(None, None) == []


def test_the_device_count_equals_torchs_on_this_machine() -> None:
    """On a GPU machine NVML and CUDA see the same devices; on a CPU one, none."""
    import torch

    from deploy.gpu_groups import device_count

    assert device_count() == torch.cuda.device_count()


def test_pd_workers_sharing_a_gpu_default_to_the_cpu_transport(tmp_path: Path) -> None:
    args = _parse("--prefill", "1", "--decode", "1", "--prefill-tp", "2", "--gpus", "0,1,0")
    _, workers, _ = build_children(args, engine_argv(args), tmp_path)
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0,1", "0"]
    transports = {json.loads(w.argv[w.argv.index("--kv-transfer-config") + 1])
                  ["kv_connector_extra_config"]["transport"] for w in workers}
    assert transports == {"cpu"}  # NCCL cannot pair GPU 0 with itself
