"""What one huge request costs the other clients of a worker, on CPU.

Why: a worker's API process reads, decodes and tokenizes every prompt; a 10 MB prompt once
took 12-19 s of tokenizing before its refusal, small requests waited up to 7.4 s behind it,
and the process kept ~2 GB. Here the real server (demo model, engine process) answers small
``/tokenize`` requests (the front end's path: body, JSON, tokenizer; no model step) alone,
then while 10 MB completion prompts and 40 MB bodies arrive, and
reports each small request's latency (p50 / max) in both phases, how the big ones were
answered and how long that took, and the API process's resident memory before and after.

    python3 -m benchmarks.big_prompt [--big-mb 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import statistics
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import aiohttp
from aiohttp import web

SMALL = {"prompt": "Hello there"}


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


async def _small_latencies(session: aiohttp.ClientSession, url: str, count: int,
                           gap_s: float) -> list[float]:
    latencies = []
    for _ in range(count):
        started = time.monotonic()
        async with session.post(url + "/tokenize", json=SMALL) as response:
            assert response.status == 200, await response.text()
            await response.read()
        latencies.append(time.monotonic() - started)
        await asyncio.sleep(gap_s)
    return latencies


def _send_big(url: str, big_mb: float, rounds: int, answers: Any) -> None:
    """In its own process (the server's loop then carries only the server's work): post
    ``rounds`` prompts of ``big_mb`` MB and one 40 MB body at once; (status, seconds) each."""
    words = "the quick brown fox jumps over the lazy dog "
    big = json.dumps({"prompt": (words * int(big_mb * 2**20 / len(words))),
                      "max_tokens": 1}).encode()
    oversized = b'{"prompt": "' + b"x" * (40 << 20) + b'"}'

    def post(body: bytes) -> None:
        started = time.monotonic()
        request = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                status = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except OSError:  # the server closed the connection on a refused body mid-upload
            status = 0
        answers.put((status, round(time.monotonic() - started, 3)))

    threads = [threading.Thread(target=post, args=(body,))
               for body in [big] * rounds + [oversized]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


async def run(big_mb: float, rounds: int) -> dict[str, Any]:
    from engine_core.arg_utils import engine_config_from_args
    from engine_core.demo_model import random_demo_model_path
    from engine_core.server.api_server import ServerOptions, app_runner, start_engine_and_app

    parser = argparse.ArgumentParser()
    from engine_core.arg_utils import add_engine_args

    add_engine_args(parser)
    args = parser.parse_args(["--device", "cpu", "--num-gpu-blocks-override", "256"])
    args.model = str(random_demo_model_path())
    config = engine_config_from_args(args)
    options = ServerOptions(log_stats_interval_s=0)
    client, app = await start_engine_and_app(config, options)
    runner = app_runner(app, options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    context = mp.get_context("spawn")
    answers = context.Queue()
    try:
        async with aiohttp.ClientSession() as session:
            await _small_latencies(session, url, 3, 0.0)  # warm up
            rss_before = _rss_mb()
            alone = await _small_latencies(session, url, 20, 0.05)
            sender = context.Process(target=_send_big, args=(url, big_mb, rounds, answers))
            sender.start()
            during = await _small_latencies(session, url, 40, 0.05)
            await asyncio.get_running_loop().run_in_executor(None, sender.join)
            rss_after = _rss_mb()
    finally:
        await runner.cleanup()
        await client.shutdown()
    return {
        "small_alone_ms": {"p50": 1e3 * statistics.median(alone), "max": 1e3 * max(alone)},
        "small_during_big_ms": {"p50": 1e3 * statistics.median(during),
                                "max": 1e3 * max(during)},
        "big_answers": [{"status": s, "seconds": t}
                        for s, t in (answers.get() for _ in range(rounds + 1))],
        "api_rss_mb": {"before": round(rss_before), "after": round(rss_after),
                       "peak": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big-mb", type=float, default=10.0, help="size of each big prompt")
    parser.add_argument("--rounds", type=int, default=3, help="big prompts sent at once")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.big_mb, args.rounds)), indent=2))


if __name__ == "__main__":
    main()
