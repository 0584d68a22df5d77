"""Real 1P1D and 2P2D clusters on CPU (`python -m deploy.launch`) give colocated greedy output."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from deploy.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 150.0
MODEL = "tiny-1p1d"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes".split()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_http(url: str, deadline: float, procs: list[subprocess.Popen], logs: list[Path]) -> None:
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs, strict=True):
            assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                if response.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    pytest.fail(f"{url} not ready in {STARTUP_S}s:\n" + "\n".join(p.read_text()[-3000:] for p in logs))


def _requests() -> list[tuple[str, bool, dict]]:
    """16 mixed requests: completions and chat, streaming and not, short and multi-block."""
    out = []
    for i in range(16):
        words = [WORDS[(i * 3 + k) % len(WORDS)] for k in range(3 + (i * 7) % 40)]
        text, max_tokens, stream = " ".join(words), 4 + i % 9, bool(i % 2)
        if i % 4 < 2:
            body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0}
            path = "/v1/completions"
        else:
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}],
                    "max_tokens": max_tokens, "temperature": 0}
            path = "/v1/chat/completions"
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        out.append((path, stream, body))
    return out


async def _one(session: aiohttp.ClientSession, base: str, path: str, stream: bool,
               body: dict) -> tuple[str, dict]:
    async with session.post(base + path, json=body) as response:
        assert response.status == 200, await response.text()
        if not stream:
            data = await response.json()
            choice = data["choices"][0]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            return text, data["usage"]
        text, usage = "", None
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            assert "error" not in event, event
            for choice in event.get("choices") or []:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            usage = event.get("usage") or usage
        assert usage is not None, "stream without final usage"
        return text, usage


async def _run_all(base: str) -> list[tuple[str, dict]]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(_one(session, base, p, s, b) for p, s, b in _requests()))


def _check(got: list[tuple[str, dict]], want: list[tuple[str, dict]]) -> None:
    for (path, _, body), (text, usage), (ref_text, ref_usage) in zip(
            _requests(), got, want, strict=True):
        assert text == ref_text, (path, body)
        assert text, (path, body)
        assert usage["prompt_tokens"] == ref_usage["prompt_tokens"], (path, body)
        assert usage["completion_tokens"] == ref_usage["completion_tokens"] == body["max_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("num_prefill,num_decode", [(1, 1), (2, 2)], ids=["1P1D", "2P2D"])
def test_cluster_matches_colocated(tmp_path: Path, num_prefill: int, num_decode: int) -> None:
    from engine_core.demo_model import build_checkpoint

    ckpt = build_checkpoint(tmp_path / "ckpt", num_layers=2, hidden_size=64, vocab_size=1024)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    engine = ["--device", "cpu", "--served-model-name", MODEL, "--max-model-len", "256",
              "--num-gpu-blocks-override", "256"]
    proxy_port, serve_port = free_port(), free_port()
    launch_log, serve_log = tmp_path / "launch.log", tmp_path / "serve.log"
    with open(launch_log, "wb") as out1, open(serve_log, "wb") as out2:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "deploy.launch", "--prefill", str(num_prefill),
             "--decode", str(num_decode),
             "--model", str(ckpt), "--port", str(proxy_port), "--log-dir", str(tmp_path / "logs"),
             "--heartbeat-interval", "1", "--stop-timeout", "10", "--restart", *engine],
            cwd=ROOT, env=env, stdout=out1, stderr=subprocess.STDOUT)
        colocated = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", str(ckpt), "--port", str(serve_port),
             *engine], cwd=ROOT, env=env, stdout=out2, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_S
        _wait_http(f"http://127.0.0.1:{serve_port}/health", deadline, [colocated], [serve_log])
        while f"ready: {num_prefill}P{num_decode}D" not in launch_log.read_text():
            assert launcher.poll() is None, launch_log.read_text()[-4000:]
            assert time.monotonic() < deadline, launch_log.read_text()[-4000:]
            time.sleep(0.5)

        proxy = f"http://127.0.0.1:{proxy_port}"
        want = asyncio.run(_run_all(f"http://127.0.0.1:{serve_port}"))
        _check(asyncio.run(_run_all(proxy)), want)

        # A decode worker that dies is reported and restarted, and serves again.
        first_pid = int(re.findall(r"decode0 \(pid (\d+)\)", launch_log.read_text())[0])
        orphans = _children(first_pid)  # its engine process must notice and exit too
        assert orphans
        os.kill(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + STARTUP_S
        while len(re.findall(r"started decode0 \(pid (\d+)\)", launch_log.read_text())) < 2:
            assert time.monotonic() < deadline, launch_log.read_text()[-4000:]
            time.sleep(0.5)
        assert f"decode0 (pid {first_pid}) died" in launch_log.read_text()
        decode = [w["http_address"] for w in json.load(urllib.request.urlopen(
            f"{proxy}/instances", timeout=5))["workers"] if w["role"] == "D"]
        assert len(decode) == num_decode, decode
        for address in decode:
            _wait_http(f"http://{address}/health", deadline, [launcher], [launch_log])
        time.sleep(1.5)  # one heartbeat: the proxy has seen the restarted worker
        _check(asyncio.run(_run_all(proxy)), want)

        # The KV came over the connector: no D ever fell back to recomputing a prompt.
        for index in range(num_decode):
            decode_log = (tmp_path / "logs" / f"decode{index}.log").read_text()
            assert "recomputing the prompt locally" not in decode_log, decode_log[-4000:]
            assert "kv load" not in decode_log, decode_log[-4000:]

        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", launch_log.read_text())]
        pids = [p for p in pids if _alive(p)]
        assert len(pids) == 1 + num_prefill + num_decode, launch_log.read_text()
        pids += [c for pid in pids for c in _children(pid)]  # the workers' engine processes
        assert len(pids) >= 1 + 2 * (num_prefill + num_decode), pids
        pids += orphans
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=40)
        assert launcher.returncode == 0, launch_log.read_text()[-4000:]
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], launch_log.read_text()[-4000:]
        assert "stopped" in launch_log.read_text()
    finally:
        for proc in (launcher, colocated):  # SIGTERM first: the launcher stops its children
            if proc.poll() is None:
                proc.terminate()
        for proc in (launcher, colocated):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
