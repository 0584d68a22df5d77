"""`pdserve launch` tensor-parallel GPU groups, per-kind sizes, and the refusal of TP > 1 for
workers with a KV connector (prefill, decode, placed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.cli import build_parser
from deploy.gpu_groups import check_tp_topology, gpu_groups
from deploy.launch import build_children, engine_argv, run_launch
from engine_core.errors import ConfigError


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
    monkeypatch.setattr("deploy.launch.detect_gpus", lambda _: [])
    _, workers, _ = build_children(args, engine_argv(args), tmp_path)
    assert [_tp_of(w.argv) for w in workers] == ["1", "1", "2"]
    assert {w.env["OMP_NUM_THREADS"] for w in workers} == {"2"}  # 8 cores over 4 ranks


def test_too_few_gpus_for_the_groups_is_a_clear_error() -> None:
    assert gpu_groups(["4", "5", "6"], [1, 2]) == ["4", "5,6"]
    with pytest.raises(SystemExit, match=r"need 4 GPUs"):
        gpu_groups(["0", "1", "2"], [2, 2])


def test_pd_workers_with_tp_are_refused_before_anything_starts(capsys) -> None:
    with pytest.raises(ConfigError, match="between tensor-parallel layouts"):
        check_tp_topology(_parse("--prefill", "1", "--decode", "1", "-tp", "2"))
    with pytest.raises(ConfigError, match="between tensor-parallel layouts"):
        check_tp_topology(_parse("--prefill", "1", "--decode", "1", "--decode-tp", "2"))
    check_tp_topology(_parse("--prefill", "1", "--decode", "1", "--colocated", "1",
                             "--colocated-tp", "2"))
    assert run_launch(_parse("--prefill", "1", "--decode", "1", "-tp", "2")) == 2
    assert "tensor-parallel" in capsys.readouterr().err


def test_placed_workers_with_tp_are_refused(capsys) -> None:
    for argv in (["-tp", "2"], ["--workers", "1", "--worker-tp", "2"],
                 ["--workers", "1", "--colocated", "1", "-tp", "2"]):
        with pytest.raises(ConfigError, match="placed"):
            check_tp_topology(_parse(*argv))
    assert run_launch(_parse("-tp", "2")) == 2  # the default launch: placed workers
    assert "between tensor-parallel layouts" in capsys.readouterr().err


def test_placed_workers_take_one_gpu_and_colocated_their_group(tmp_path: Path) -> None:
    args = _parse("--workers", "2", "--colocated", "1", "--colocated-tp", "2",
                  "--gpus", "0,1,2,3")
    check_tp_topology(args)
    _, workers, _ = build_children(args, engine_argv(args), tmp_path)
    assert [w.name for w in workers] == ["worker0", "worker1", "colocated0"]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0", "1", "2,3"]
    assert [_tp_of(w.argv) for w in workers] == ["1", "1", "2"]


def test_gpus_count_the_visible_ones(monkeypatch) -> None:
    from deploy.launch import detect_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert detect_gpus("0,1,1") == ["2", "3", "3"]
    assert detect_gpus(None) == ["2", "3"]
    with pytest.raises(SystemExit, match="beyond"):
        detect_gpus("0,2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert detect_gpus("4,5") == ["4", "5"]
