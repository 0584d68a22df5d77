"""What ``pdserve launch`` prints once ready, and what it leaves behind.

The banner lists every process (role, HTTP address, metrics URL) and a ``pdserve bench serve``
command that ``pdserve``'s own parser reads back as aimed at this proxy and model. The log
folder launch made itself goes away on a clean exit and stays (and is named) on a failure;
a ``--log-dir`` the user gave is never removed.
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from benchmarks.serve.config import config_from_args
from deploy.banner import CPU_BENCH_FLAGS, bench_command, bench_tokenizer, launch_banner
from deploy.cli import build_parser
from deploy.launch import build_children, engine_argv, free_port
from deploy.launch_logs import TEMP_PREFIX, LaunchLogs
from tests.integration.cluster_harness import (
    ENGINE_ARGS,
    MODEL,
    ROOT,
    STARTUP_S,
    build_tiny_checkpoint,
    child_env,
)

# Launch plans for GPUs that no CUDA_VISIBLE_DEVICES of the machine running them narrows.
pytestmark = pytest.mark.usefixtures("no_cuda_visible_devices")


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", "--model", "/m", *argv])


def _bench_args(command: str) -> argparse.Namespace:
    """The banner's bench command as ``pdserve`` parses it."""
    argv = shlex.split(command)
    assert argv[:3] == ["pdserve", "bench", "serve"], command
    return build_parser().parse_args(argv[1:])


def test_the_banner_shows_every_process_and_a_matching_bench_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    args = _parse("--prefill", "1", "--decode", "2", "--colocated", "1", "--port", "12345")
    _, workers, url = build_children(args, engine_argv(args), tmp_path)
    text = launch_banner("1P2D + 1 colocated", url, workers, "served-name", "/m")
    lines = text.splitlines()
    assert lines[0] == "pdserve launch: ready: 1P2D + 1 colocated at http://127.0.0.1:12345"
    rows = {line.split()[0]: line.split() for line in lines[1:-2]}
    assert list(rows) == ["proxy", "prefill0", "decode0", "decode1", "colocated0"]
    assert rows["proxy"][1:] == ["proxy", url, "metrics", f"{url}/metrics"]
    for worker in workers:
        address = f"http://{worker.http_address}"
        assert rows[worker.name][1:] == [re.sub(r"\d+$", "", worker.name), address,
                                         "metrics", f"{address}/metrics"]
    assert lines[-2].startswith(f"  try:   curl {url}/v1/completions ")
    assert '"model": "served-name"' in lines[-2]
    assert lines[-1].startswith("  bench: ")
    bench = config_from_args(_bench_args(lines[-1][len("  bench: "):]))
    assert bench.base_url == url
    # Served under another name: the benchmark reads the tokenizer from the launched model.
    assert bench.model == "served-name" and bench.tokenizer == "/m"
    assert bench.dataset.num_prompts == int(CPU_BENCH_FLAGS[1])  # CPU workers: a light load


def test_gpu_workers_get_the_benchmarks_own_defaults(tmp_path: Path) -> None:
    args = _parse("--gpus", "0,1")
    _, workers, url = build_children(args, engine_argv(args), tmp_path)
    command = launch_banner("2 workers", url, workers, "m", "m").splitlines()[-1]
    defaults = config_from_args(build_parser().parse_args(["bench", "serve"]))
    bench = config_from_args(_bench_args(command.split("bench: ", 1)[1]))
    assert bench.dataset == defaults.dataset


def test_bench_tokenizer_only_when_the_served_name_does_not_find_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_core.default_model import DEFAULT_MODEL_NAME
    from engine_core.errors import ModelLoadError

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    # A checkpoint served under another name: the benchmark needs the path for its tokenizer.
    assert bench_tokenizer("tiny", str(checkpoint)) == str(checkpoint)
    assert bench_tokenizer(str(checkpoint), str(checkpoint)) is None  # --model is the path
    assert bench_tokenizer("org/hub-model", "org/hub-model") is None
    monkeypatch.setattr("engine_core.default_model.default_model_path", lambda: checkpoint)
    assert bench_tokenizer(DEFAULT_MODEL_NAME, str(checkpoint)) is None  # found by its name
    def not_installed() -> Path:
        raise ModelLoadError("not installed")

    monkeypatch.setattr("engine_core.default_model.default_model_path", not_installed)
    assert bench_tokenizer(DEFAULT_MODEL_NAME, str(checkpoint)) == str(checkpoint)
    command = bench_command("http://h:1", "tiny", str(checkpoint))
    assert _bench_args(command).tokenizer == str(checkpoint)


def test_an_owned_log_folder_goes_on_a_clean_exit_and_stays_on_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    clean = LaunchLogs.create(None)
    assert clean.owned and clean.path.parent == tmp_path
    assert clean.path.name.startswith(TEMP_PREFIX)
    assert "removed on a clean exit" in clean.describe()
    (clean.path / "proxy.log").write_text("ok")
    assert clean.finish(0) is None
    assert not clean.path.exists()

    failed = LaunchLogs.create(None)
    (failed.path / "decode0.log").write_text("Traceback ...")
    assert failed.finish(1) == f"logs kept in {failed.path}"
    assert (failed.path / "decode0.log").exists()

    nothing = LaunchLogs.create(None)  # failed before any child wrote a line
    assert nothing.finish(1) is None
    assert not nothing.path.exists()


def test_a_given_log_dir_is_never_removed(tmp_path: Path) -> None:
    given = tmp_path / "mine" / "logs"
    logs = LaunchLogs.create(str(given))
    assert logs == LaunchLogs(given, owned=False) and given.is_dir()
    assert "removed" not in logs.describe()
    assert logs.finish(0) is None
    assert given.is_dir()
    assert logs.finish(1) == f"logs kept in {given}"
    assert given.is_dir()


def _launch(tmp_path: Path, *argv: str) -> tuple[subprocess.Popen, Path]:
    """A real ``pdserve launch`` whose own temp folders land in ``tmp_path/tmp``."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    log = tmp_path / "launch.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "launch", "--colocated", "1",
             "--port", str(free_port()), "--heartbeat-interval", "1", "--stop-timeout", "10",
             *argv], cwd=ROOT, env={**child_env(), "TMPDIR": str(temp)},
            stdout=out, stderr=subprocess.STDOUT)
    return launcher, log


def _owned_folders(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "tmp").glob(f"{TEMP_PREFIX}*"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_launch_prints_working_urls_and_cleans_up(tmp_path: Path) -> None:
    """The banner's metrics URLs answer; SIGTERM ends the launch with 0 and its own log
    folder is gone."""
    checkpoint = build_tiny_checkpoint(tmp_path / "ckpt")
    launcher, log = _launch(tmp_path, "--model", str(checkpoint), *ENGINE_ARGS)
    try:
        deadline = time.monotonic() + STARTUP_S
        while "  bench: " not in log.read_text():
            assert launcher.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        text = log.read_text()
        assert len(_owned_folders(tmp_path)) == 1, text
        metrics = re.findall(r"^  (\S+) +(\S+) +(\S+) +metrics (\S+)$", text, re.MULTILINE)
        assert [(name, role) for name, role, _, _ in metrics] == [
            ("proxy", "proxy"), ("colocated0", "colocated")], text
        for _, _, _, url in metrics:
            with urllib.request.urlopen(url, timeout=10) as response:
                assert response.status == 200 and b"# TYPE" in response.read()
        bench = _bench_args(re.search(r"  bench: (.*)", text).group(1))
        assert bench.base_url == metrics[0][2] and bench.model == MODEL
        assert bench.tokenizer == str(checkpoint)  # served as MODEL, tokenizer in the checkpoint
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0, log.read_text()[-4000:]
        assert _owned_folders(tmp_path) == [], log.read_text()[-4000:]
        assert "logs kept" not in log.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failed_launch_keeps_its_logs_and_says_where(tmp_path: Path) -> None:
    launcher, log = _launch(tmp_path, "--model", str(tmp_path / "no-such-model"),
                            "--device", "cpu")
    try:
        assert launcher.wait(timeout=STARTUP_S) == 1, log.read_text()[-4000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    text = log.read_text()
    [folder] = _owned_folders(tmp_path)
    assert f"logs kept in {folder}" in text, text[-4000:]
    assert (folder / "colocated0.log").read_text(), text[-4000:]
