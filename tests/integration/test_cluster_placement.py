"""`pdserve launch --workers 2` on CPU: the proxy places each request (whole on one worker, or
prefilled on one and decoded on the other), the output equals a colocated `pdserve serve`,
and changing a worker's capabilities while requests run loses none of them."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from deploy.launch import free_port
from tests.integration.cluster_harness import (
    ENGINE_ARGS,
    ROOT,
    STARTUP_S,
    Cluster,
    build_tiny_checkpoint,
    check_matches,
    child_env,
    idle_violations,
    mixed_requests,
    run_all,
    send_all,
    wait_http,
    wait_idle,
)

# Prompts of more than 12 estimated tokens count as long: the mix has both kinds.
LAUNCH_FLAGS = ["--placement-short-prompt-tokens", "12"]


def _placements(proxy_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{proxy_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for placement, value in re.findall(
            r'^pdserve:proxy_placements_total\{placement="(\w+)",reason="\w+"\} (\S+)$', text,
            re.M):
        counts[placement] = counts.get(placement, 0.0) + float(value)
    return counts


def _set_capabilities(proxy_url: str, worker: str, capabilities: list[str] | None) -> None:
    request = urllib.request.Request(
        f"{proxy_url}/instances/capabilities", method="POST",
        data=json.dumps({"worker": worker, "capabilities": capabilities}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


@pytest.mark.timeout(300)
def test_workers_place_requests_and_match_colocated(tmp_path: Path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    cluster = Cluster.build(tmp_path / "logs", ckpt, num_workers=2, launch_flags=LAUNCH_FLAGS)
    assert [w.name for w in cluster.workers] == ["worker0", "worker1"]
    serve_port, serve_log = free_port(), tmp_path / "serve.log"
    with open(serve_log, "wb") as out:
        colocated = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", str(ckpt), "--port", str(serve_port),
             *ENGINE_ARGS], cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        cluster.start([cluster.proxy, *cluster.workers])
        wait_http(f"http://127.0.0.1:{serve_port}/health", time.monotonic() + STARTUP_S,
                  [colocated], [serve_log])
        cluster.wait_ready([cluster.proxy, *cluster.workers])
        serve = f"http://127.0.0.1:{serve_port}"
        assert {w["role"] for w in cluster.instances()} == {"worker"}

        # Short and long prompts, completions and chat, streamed and not, all at once.
        reqs = mixed_requests(12)
        want = run_all(serve, reqs)
        check_matches(reqs, run_all(cluster.url, reqs), want)

        # Capabilities change while requests run: worker0 only prefills and worker1 only
        # decodes for a while (every request placed then is disaggregated), then both get
        # everything back. No request is lost and every answer equals colocated's.
        first, second = (w.http_address for w in cluster.workers)
        wave = mixed_requests(18, offset=12)
        want = run_all(serve, wave)

        async def load_with_role_changes() -> list:
            # Thirds: the first runs across the change to split roles, the second is placed
            # under split roles (each of its requests is disaggregated), the third runs across
            # the change back. Each change waits on an event, not on a timing.
            first_part, split_part, last_part = wave[:6], wave[6:12], wave[12:]
            early = asyncio.create_task(send_all(cluster.url, first_part, concurrency=3))
            await asyncio.sleep(0.2)
            await asyncio.to_thread(_set_capabilities, cluster.url, first, ["prefill"])
            await asyncio.to_thread(_set_capabilities, cluster.url, second, ["decode"])
            before = _placements(cluster.url).get("disaggregated", 0.0)
            split = asyncio.create_task(send_all(cluster.url, split_part, concurrency=3))
            while (_placements(cluster.url).get("disaggregated", 0.0) < before + 3
                   and not split.done()):
                await asyncio.sleep(0.05)
            for worker in (first, second):
                await asyncio.to_thread(_set_capabilities, cluster.url, worker, None)
            late = await send_all(cluster.url, last_part, concurrency=3)
            return [*await early, *await split, *late]

        check_matches(wave, asyncio.run(load_with_role_changes()), want)
        counts = _placements(cluster.url)
        assert counts.get("local", 0) > 0 and counts.get("disaggregated", 0) >= 3, counts
        roles = {w["http_address"]: w for w in cluster.instances()}
        assert roles[first]["role_mix"]["total"].get("prefill", 0) >= 3
        assert roles[second]["role_mix"]["total"].get("decode", 0) >= 3
        assert all(sorted(w["capabilities"]) == ["decode", "prefill", "whole"]
                   for w in roles.values())
        # The lane planner saw every placed prompt and the streams that ended.
        with urllib.request.urlopen(f"{cluster.url}/instances", timeout=10) as response:
            observed = json.load(response)["lanes"]["observed"]
        assert observed["prompts"] == len(reqs) + len(wave)
        assert observed["outputs"] >= sum(1 for r in [*reqs, *wave] if r.stream)

        # Nothing held: every transfer ended, every block is free.
        scraped = wait_idle([first, second], 30.0)
        assert not idle_violations(scraped), (idle_violations(scraped), cluster.logs())
    finally:
        cluster.stop()
        colocated.terminate()
        try:
            colocated.wait(timeout=30)
        except subprocess.TimeoutExpired:
            colocated.kill()
            colocated.wait()
