"""Real-process cluster helpers for the CPU integration tests.

Clusters are built with ``deploy.launch``'s own wiring (``build_children``: the same argv,
ports and kv JSON ``pdserve launch`` uses), but each process is started and killed by the
test, so a test can start a worker late, freeze or SIGKILL one, and read every worker's
``/metrics``. Requests never assert inside the client: each returns an ``Outcome`` the test
judges, so a failure mode (hang, empty 200, truncated stream) is reported, not masked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from deploy.launch import Child, add_launch_arguments, build_children, engine_argv, free_port

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 150.0
MODEL = "tiny-cluster"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes".split()
# No cluster here needs the grammar engine before its first constrained request: its timed
# import (about 1 s of CPU in every worker that lives 10 s) would only slow the tests down.
ENGINE_ARGS = ["--device", "cpu", "--served-model-name", MODEL, "--max-model-len", "256",
               "--num-gpu-blocks-override", "256", "--grammar-import-delay", "inf"]

# Connector gauges every P/D worker exports; each must read 0 on an idle cluster.
CONNECTOR_IDLE_GAUGES = (
    "pdserve:kv_transfer_recv_buffer_bytes_in_use",
    "pdserve:kv_transfer_send_buffer_bytes_in_use",
    "pdserve:kv_transfer_pinned_bytes_in_use",
    "pdserve:kv_transfer_loads_pending",
    "pdserve:kv_transfer_loads_in_flight",
    "pdserve:kv_transfer_loads_waiting_for_buffer",
    "pdserve:kv_transfer_sends_in_flight",
    "pdserve:kv_transfer_sends_pending_pull",
    "pdserve:kv_transfer_producer_requests",
    "pdserve:kv_transfer_held_requests",
    "pdserve:kv_transfer_pull_requests_waiting",
)
ENGINE_IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                      "vllm:kv_cache_usage_perc")


def build_tiny_checkpoint(path: Path) -> Path:
    """The tiny checkpoint every cluster test serves (2 layers, hidden 64)."""
    from engine_core.demo_model import build_checkpoint

    return Path(build_checkpoint(path, num_layers=2, hidden_size=64, vocab_size=1024))


def child_env() -> dict[str, str]:
    """Environment for child processes: this checkout first on the import path."""
    return dict(os.environ,
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


# ---- processes -------------------------------------------------------------------------------


def stop_process(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM ``proc`` (a launcher or server), SIGKILL it if it outlives ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
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


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_http(url: str, deadline: float, procs: Sequence[subprocess.Popen],
              logs: Sequence[Path]) -> None:
    """Poll ``url`` (every 0.05 s: a refused connection costs next to nothing, and a test
    waits for many starts) until 200; fail early when one of ``procs`` exited."""
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs, strict=True):
            assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                if response.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.05)
    pytest.fail(f"{url} not ready in time:\n" + "\n".join(p.read_text()[-3000:] for p in logs))


def registered_workers(proxy_url: str) -> set[str]:
    """The HTTP addresses a proxy lists in ``/instances`` (none while it does not answer)."""
    try:
        return {w["http_address"] for w in get_json(f"{proxy_url}/instances", timeout=2.0)["workers"]}
    except OSError:
        return set()


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)", line)
        if match:
            out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(3))
    return out


def scrape(http_address: str) -> dict[str, float]:
    """One worker's (or the proxy's) /metrics, parsed."""
    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=10) as response:
        return parse_metrics(response.read().decode())


def labelled_counter(http_address: str, name: str) -> dict[str, float]:
    """``{label value: count}`` of a one-label counter on ``http_address``'s /metrics."""
    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.findall(rf'^{re.escape(name)}_total\{{\w+="([^"]*)"\}} (\S+)$', text, re.M)
    return {label: float(value) for label, value in found}


def request_successes(http_address: str) -> float:
    """Requests a worker completed so far (its ``vllm:request_success_total``)."""
    return scrape(http_address).get("vllm:request_success_total", 0.0)


@dataclass
class Cluster:
    """A proxy and its workers, built by ``deploy.launch.build_children``; started by the test."""

    log_dir: Path
    proxy: Child
    workers: list[Child]
    url: str
    registration_port: int
    started: list[Child] = field(default_factory=list)

    @classmethod
    def build(cls, log_dir: Path, checkpoint: Path, num_prefill: int = 0, num_decode: int = 0,
              heartbeat_s: float = 1.0, heartbeat_timeout_s: float | None = None,
              kv_extra: dict | None = None, launch_flags: Sequence[str] = (),
              num_workers: int = 0) -> Cluster:
        """Plan (not start) ``num_prefill`` P and ``num_decode`` D workers (or, with
        ``num_workers``, that many workers the proxy places requests on) plus the proxy."""
        log_dir.mkdir(parents=True, exist_ok=True)
        parser = argparse.ArgumentParser()
        add_launch_arguments(parser)
        reg_port = free_port()
        shape = (["--workers", str(num_workers)] if num_workers else
                 ["--prefill", str(num_prefill), "--decode", str(num_decode)])
        args = parser.parse_args([
            *shape, "--model",
            str(checkpoint), "--port", str(free_port()), "--registration-port", str(reg_port),
            "--heartbeat-interval", str(heartbeat_s), *launch_flags, *ENGINE_ARGS])
        # A CPU cluster on any machine: on a GPU machine the launcher's plan would give each
        # worker a GPU (and refuse more workers than GPUs). Said here, not left to the
        # per-test fixture that hides the GPUs (tests/conftest.py): session and module
        # fixtures build their clusters before it runs.
        proxy, workers, url = build_children(args, engine_argv(args), log_dir,
                                             {**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        path = {"PYTHONPATH": child_env()["PYTHONPATH"]}  # the launcher's env, this checkout
        proxy.env = {**proxy.env, **path}
        if heartbeat_timeout_s is not None:
            proxy.argv += ["--heartbeat-timeout", str(heartbeat_timeout_s)]
        for worker in workers:
            worker.env = {**worker.env, **path}
            if kv_extra:
                _patch_kv_config(worker, kv_extra)
        return cls(log_dir, proxy, workers, url, reg_port)

    def worker(self, name: str) -> Child:
        return next(w for w in self.workers if w.name == name)

    def start(self, children: Iterable[Child]) -> None:
        for child in children:
            child.start()
            self.started.append(child)

    def wait_ready(self, children: Iterable[Child], deadline_s: float = STARTUP_S) -> None:
        """Until each child is healthy and (workers) registered with the proxy."""
        deadline = time.monotonic() + deadline_s
        children = list(children)
        procs = [c.proc for c in self.started]
        logs = [c.log_path for c in self.started]
        wait_http(f"{self.url}/health", deadline, procs, logs)
        for child in children:
            if child is not self.proxy:
                wait_http(f"http://{child.http_address}/health", deadline, procs, logs)
        want = {c.http_address for c in children if c is not self.proxy}
        while not want <= self.registered():
            assert time.monotonic() < deadline, f"not registered: {want - self.registered()}"
            time.sleep(0.1)

    def second_proxy(self, http_port: int, registration_port: int) -> Child:
        """Proxy B: this cluster's proxy command line on its own ports."""
        argv = list(self.proxy.argv)
        argv[argv.index("--port") + 1] = str(http_port)
        argv[argv.index("--registration-port") + 1] = str(registration_port)
        return Child("proxy_b", argv, self.proxy.env, self.log_dir / "proxy_b.log")

    def instances(self) -> list[dict]:
        return get_json(f"{self.url}/instances")["workers"]

    def registered(self) -> set[str]:
        return {w["http_address"] for w in self.instances()}

    def pids(self, child: Child) -> list[int]:
        """The worker's API process and its engine-core process."""
        assert child.proc is not None
        return [child.proc.pid, *children_of(child.proc.pid)]

    def signal_engine(self, child: Child, signum: int) -> None:
        """Send ``signum`` to the worker's engine-core process(es) only."""
        assert child.proc is not None
        engines = children_of(child.proc.pid)
        assert engines, f"{child.name} has no engine process"
        for pid in engines:
            os.kill(pid, signum)

    def kill(self, child: Child) -> None:
        """SIGKILL the whole worker (API and engine process): a crashed machine."""
        assert child.proc is not None
        os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM everything started (then SIGKILL after a deadline) and close logs."""
        from deploy.launch import stop_all

        for child in self.started:  # a frozen engine cannot handle SIGTERM
            if child.proc is not None and child.proc.poll() is None:
                for pid in children_of(child.proc.pid):
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except OSError:
                        pass
        stop_all(self.started, 20.0)

    def logs(self) -> str:
        return "\n".join(f"--- {c.name}\n{c.log_path.read_text()[-3000:]}" for c in self.started)


def _patch_kv_config(worker: Child, kv_extra: dict) -> None:
    index = worker.argv.index("--kv-transfer-config") + 1
    kv = json.loads(worker.argv[index])
    kv["kv_connector_extra_config"].update(kv_extra)
    worker.argv[index] = json.dumps(kv)


class Throttle:
    """Slows ``victim``'s engine about tenfold by stopping it 90 ms of every 100 ms.

    A test that acts on streams mid-way (freezes or kills a process) needs them still
    running: unthrottled, the tiny model decodes a whole long stream in a few tenths of a
    second, about the time a trigger's /metrics polling takes on a loaded 2-core machine. A
    thread, not a task, so the client coroutines sharing the event loop do not stretch the
    running phase."""

    def __init__(self, cluster: Cluster, victim: Child) -> None:
        self._cluster, self._victim = cluster, victim
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.is_set():
            self._cluster.signal_engine(self._victim, signal.SIGSTOP)
            time.sleep(0.09)
            self._cluster.signal_engine(self._victim, signal.SIGCONT)
            time.sleep(0.01)

    def __enter__(self) -> Throttle:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stops throttling, leaving the engine running (the last signal sent is SIGCONT)."""
        self._done.set()
        self._thread.join()


def wait_idle(addresses: Sequence[str], deadline_s: float) -> dict[str, dict[str, float]]:
    """Poll each worker's /metrics until every idle gauge reads 0; return the last scrape."""
    deadline = time.monotonic() + deadline_s
    while True:
        scraped = {a: scrape(a) for a in addresses}
        busy = idle_violations(scraped)
        if not busy or time.monotonic() > deadline:
            return scraped
        time.sleep(0.2)


def idle_violations(scraped: dict[str, dict[str, float]]) -> list[str]:
    """Each non-zero (or missing) idle gauge, as 'address name=value'."""
    bad = []
    for address, metrics in scraped.items():
        for name in (*ENGINE_IDLE_GAUGES, *CONNECTOR_IDLE_GAUGES):
            value = metrics.get(name)
            if value != 0.0:
                bad.append(f"{address} {name}={value}")
    return bad


def colocated_answers(checkpoint: Path, reqs: Sequence[Req], log: Path) -> list[Outcome]:
    """``reqs`` answered by one colocated ``pdserve serve`` of ``checkpoint`` (TP=1, the
    reference every disaggregated shape must equal), stopped afterwards."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", str(checkpoint), "--port", str(port),
             *ENGINE_ARGS], cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", time.monotonic() + STARTUP_S, [proc], [log])
        return run_all(f"http://127.0.0.1:{port}", reqs)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass(frozen=True)
class Reference:
    """The tiny checkpoint and a colocated TP=1 ``pdserve serve``'s answers to
    ``mixed_requests(len(answers))`` on it: what every disaggregated shape must equal (the
    session's ``reference`` fixture, tests/integration/conftest.py)."""

    checkpoint: Path
    answers: list[Outcome]

    def first(self, n: int) -> tuple[list[Req], list[Outcome]]:
        """``mixed_requests(n)`` (a prefix of the reference's requests) and their answers."""
        assert n <= len(self.answers), (n, len(self.answers))
        return mixed_requests(n), self.answers[:n]


# ---- requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    path: str
    stream: bool
    body: dict
    limit: int  # max_tokens (or max_completion_tokens)


def mixed_requests(n: int, max_words: int = 40, max_tokens: int = 12, offset: int = 0
                   ) -> list[Req]:
    """``n`` mixed requests: completions and chat, streaming and not, short and multi-block.

    Every fourth chat request uses ``max_completion_tokens``; streams ask for usage.
    """
    out = []
    for j in range(n):
        i = j + offset
        words = [WORDS[(i * 3 + k) % len(WORDS)] for k in range(3 + (i * 7) % max_words)]
        text, limit, stream = " ".join(words), 4 + i % (max_tokens - 3), bool(i % 2)
        body: dict = {"model": MODEL, "temperature": 0, "ignore_eos": True}
        if i % 4 < 2:
            path = "/v1/completions"
            body |= {"prompt": text, "max_tokens": limit}
        else:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": text}]
            body["max_completion_tokens" if i % 8 == 2 else "max_tokens"] = limit
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        out.append(Req(path, stream, body, limit))
    return out


def with_limit(req: Req, limit: int, stream: bool | None = None) -> Req:
    """``req`` asking for ``limit`` tokens (and streaming or not, when ``stream`` is given)."""
    body = dict(req.body)
    body["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"] = limit
    stream = req.stream if stream is None else stream
    body.pop("stream", None)
    body.pop("stream_options", None)
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return Req(req.path, stream, body, limit)


@dataclass
class Outcome:
    """What one client request saw; judged by the test, never asserted while reading."""

    status: int = 0
    elapsed: float = 0.0
    text: str = ""
    usage: dict | None = None
    error: str | None = None      # non-200 error message, or a stream's SSE error event
    done: bool = False            # stream: data: [DONE] arrived
    body: bytes = b""             # non-stream body
    finish_reason: str | None = None
    exception: str | None = None  # client side: timeout, connection dropped, bad JSON

    @property
    def ok(self) -> bool:
        """A complete, successful answer."""
        return (self.status == 200 and self.error is None and self.exception is None
                and self.usage is not None)


async def send(session: aiohttp.ClientSession, base: str, req: Req,
               timeout_s: float = 120.0) -> Outcome:
    """One request through ``base``; every failure mode is recorded in the Outcome."""
    out = Outcome()
    started = time.monotonic()
    try:
        async with session.post(base + req.path, json=req.body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            out.status = response.status
            if response.status != 200:
                out.body = await response.read()
                out.error = _error_message(out.body)
            elif not req.stream:
                out.body = await response.read()
                data = json.loads(out.body)
                choice = data["choices"][0]
                out.text = choice["text"] if "text" in choice else choice["message"]["content"]
                out.finish_reason = choice.get("finish_reason")
                out.usage = data["usage"]
            else:
                await _read_stream(response, out)
    except asyncio.TimeoutError:
        out.exception = f"timeout after {timeout_s}s"
    except (aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError) as exc:
        out.exception = f"{type(exc).__name__}: {exc}"
    out.elapsed = time.monotonic() - started
    return out


async def _read_stream(response: aiohttp.ClientResponse, out: Outcome) -> None:
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            out.done = True
            continue
        event = json.loads(payload)
        if "error" in event:
            out.error = str(event["error"].get("message") if isinstance(event["error"], dict)
                            else event["error"])
            continue
        for choice in event.get("choices") or []:
            out.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            out.finish_reason = choice.get("finish_reason") or out.finish_reason
        out.usage = event.get("usage") or out.usage
    if not out.done:
        out.exception = "stream ended without data: [DONE]"


def _error_message(body: bytes) -> str | None:
    try:
        error = json.loads(body)["error"]
        return str(error["message"]) if error.get("message") else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


async def send_all(base: str, reqs: Sequence[Req], concurrency: int | None = None,
                   timeout_s: float = 120.0) -> list[Outcome]:
    """All requests, at most ``concurrency`` at once (None: all at once); order kept."""
    limit = asyncio.Semaphore(concurrency or len(reqs) or 1)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(req: Req) -> Outcome:
            async with limit:
                return await send(session, base, req, timeout_s)

        return await asyncio.gather(*(one(r) for r in reqs))


def run_all(base: str, reqs: Sequence[Req], concurrency: int | None = None,
            timeout_s: float = 120.0) -> list[Outcome]:
    return asyncio.run(send_all(base, reqs, concurrency, timeout_s))


def check_matches(reqs: Sequence[Req], got: Sequence[Outcome], want: Sequence[Outcome]) -> None:
    """Same greedy text and usage as the reference, every request complete."""
    for req, out, ref in zip(reqs, got, want, strict=True):
        assert ref.ok, (req, ref)
        assert out.ok, (req, out)
        assert out.text == ref.text, (req.path, req.body, out.text, ref.text)
        assert out.text, req
        check_usage(req, out, ref)


def check_usage(req: Req, out: Outcome, ref: Outcome) -> None:
    usage, ref_usage = out.usage or {}, ref.usage or {}
    assert usage["prompt_tokens"] == ref_usage["prompt_tokens"], (req, usage, ref_usage)
    assert usage["completion_tokens"] == ref_usage["completion_tokens"] == req.limit, (req, usage)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
