"""`pdserve launch` makes one cluster secret per launch and hands it to every child."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

from deploy.launch import (
    CLUSTER_SECRET_FILE,
    add_launch_arguments,
    build_children,
    new_cluster_secret,
)
from engine_core.cluster.trust import load_secret_file


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    return parser.parse_args(["--demo", *argv])


def test_every_child_reads_the_launch_secret(tmp_path: Path) -> None:
    proxy, workers, _ = build_children(_parse("--prefill", "1", "--decode", "1",
                                              "--colocated", "1"), [], tmp_path)
    path = tmp_path / CLUSTER_SECRET_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for child in (proxy, *workers):
        argv = child.argv
        assert argv[argv.index("--cluster-secret-file") + 1] == str(path), child.name
    assert load_secret_file(path).is_set


def test_each_launch_makes_a_new_secret(tmp_path: Path) -> None:
    first = load_secret_file(new_cluster_secret(tmp_path))
    second = load_secret_file(new_cluster_secret(tmp_path))  # the same run dir, reused
    assert first != second
