"""How many streamed tokens a second one API server process carries, without a GPU.

Why: the API process decodes each engine step's outputs, detokenizes, and writes an SSE event
per token on one event loop; when that work outgrows the loop, streams stall for everyone
(on two H100s a decode worker's loop was held 1.2-2.3 s at a time by output decoding). Here
the engine is a stand-in (``TokenPumpEngine``) that emits one token for every running request
each ``--step-ms`` and does nothing else, so the load is the front end's alone: the real
server (`run_server`, its engine process, ZMQ, codec, detokenizer, SSE) serves ``--streams``
concurrent streaming completions of ``--tokens`` tokens each, read by a light aiohttp client.
Reported: the token rate the engine offered and the rate the clients received, the gaps
between a stream's events (p50 / p99 / max) and the server's event-loop stalls.

    python3 -m benchmarks.frontend_load --streams 64 --tokens 400 --step-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing as mp
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import engine_core
from benchmarks.output import default_out, write_json
from engine_core.messages import AddRequest, EngineOutput, EngineStats


class TokenPumpEngine:
    """The engine-core interface the engine process drives, emitting tokens on a clock:
    every ``step_ms`` each running request gets its next token (cycling over ordinary word
    ids) and ends after its ``max_tokens``."""

    def __init__(self, tokenizer_path: str, vocab_size: int, step_ms: float,
                 word_ids: Sequence[int]) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.max_model_len = 4096
        self.eos_token_ids: list[int] = []
        self.sleep_level = 0
        self.stalled = False  # every step it has work for emits (the engine loop reads it)
        self._step_s = step_ms / 1e3
        self._next_step = time.monotonic()
        self._running: dict[str, list[int]] = {}  # request id -> [emitted, max_tokens, prompt]
        self._word_ids = list(word_ids)  # tokens that decode to a whole word: one event each

    def add_request(self, message: AddRequest) -> None:
        max_tokens = int(message.sampling_params.get("max_tokens") or 16)
        self._running[message.request_id] = [0, max_tokens, len(message.prompt_token_ids)]

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._running.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._running)

    def has_runnable(self) -> bool:
        return bool(self._running)

    def has_transfer_state(self) -> bool:
        return False

    def step(self) -> list[EngineOutput]:
        delay = self._next_step - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self._next_step = max(self._next_step + self._step_s, time.monotonic())
        outputs = []
        for request_id, state in list(self._running.items()):
            state[0] += 1
            done = state[0] >= state[1]
            outputs.append(EngineOutput(
                request_id=request_id,
                new_token_ids=[self._word_ids[state[0] % len(self._word_ids)]],
                num_prompt_tokens=state[2], num_cached_tokens=0,
                finish_reason="length" if done else None))
            if done:
                del self._running[request_id]
        return outputs

    def get_stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._running), num_waiting=0,
                           num_waiting_for_remote_kv=0, kv_cache_usage=0.0, num_free_blocks=1 << 20,
                           num_total_blocks=1 << 20, prefix_cache_queries=0, prefix_cache_hits=0,
                           num_preemptions=0, prompt_tokens_total=0, generation_tokens_total=0,
                           num_computed_prompt_tokens_total=0)

    def doorbell(self) -> None:
        return None

    def peer_ranks(self) -> None:
        return None  # no KV connector

    def reset_prefix_cache(self) -> bool:
        return True

    def sleep(self, level: int = 1) -> None:
        return None

    def wake_up(self, tags: Any = None) -> None:
        return None

    def shutdown(self) -> None:
        return None


def token_pump_engine(config: Any, step_ms: float) -> TokenPumpEngine:
    """Engine factory (runs in the engine process): the demo model's tokenizer, no weights;
    it emits ids that decode to a space and a word, so that every token is one event."""
    from transformers import AutoTokenizer

    path = str(config.model.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    words = [i for i in range(len(tokenizer)) if (text := tokenizer.decode([i])).startswith(" ")
             and text[1:].isalpha() and text.isascii()][:64]
    return TokenPumpEngine(path, len(tokenizer), step_ms, words)


def _serve(port: int, step_ms: float) -> None:
    from engine_core.config import EngineConfig, ModelConfig
    from engine_core.demo_model import random_demo_model_path
    from engine_core.server.api_server import ServerOptions, run_server

    run_server(EngineConfig(model=ModelConfig(model=str(random_demo_model_path()))),
               ServerOptions(port=port, log_stats_interval_s=0),
               functools.partial(token_pump_engine, step_ms=step_ms))


async def _stream(session: Any, url: str, model: str, tokens: int, gaps: list[float]) -> int:
    body = {"model": model, "prompt": [101, 102, 103, 104], "max_tokens": tokens,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    events, last, received = 0, None, 0
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage") and not chunk.get("choices"):
                received = chunk["usage"]["completion_tokens"]
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            events += 1
    return received if events else 0


async def _load(port: int, streams: int, tokens: int) -> dict[str, Any]:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    gaps: list[float] = []
    connector = aiohttp.TCPConnector(limit=streams + 4)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(f"http://127.0.0.1:{port}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        start = time.monotonic()
        counts = await asyncio.gather(*(_stream(session, url, model, tokens, gaps)
                                        for _ in range(streams)))
        duration = time.monotonic() - start
        async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
            metrics = await response.text()
    gaps.sort()
    stalls = [line for line in metrics.splitlines()
              if line.startswith("pdserve:event_loop_stall") and not line.startswith("#")]
    return {"tokens": sum(counts), "seconds": duration,
            "received_tokens_per_s": sum(counts) / duration,
            "gap_ms_p50": 1e3 * statistics.median(gaps) if gaps else None,
            "gap_ms_p99": 1e3 * gaps[int(0.99 * (len(gaps) - 1))] if gaps else None,
            "gap_ms_max": 1e3 * gaps[-1] if gaps else None, "server_stall_metrics": stalls}


def _wait_ready(port: int, timeout_s: float = 120.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("the server did not come up")


def measure(streams: int, tokens: int, step_ms: float) -> dict[str, Any]:
    """Start a server on the token pump, stream through it, stop it; the figures."""
    from deploy.launch import free_port

    port = free_port()
    # Not a daemon: the server starts its own engine process.
    server = mp.get_context("spawn").Process(target=_serve, args=(port, step_ms))
    server.start()
    try:
        _wait_ready(port)
        result = asyncio.run(_load(port, streams, tokens))
    finally:
        server.terminate()  # SIGTERM: the server stops its engine process too
        server.join(30)
        if server.is_alive():
            server.kill()
    result.update({"streams": streams, "tokens_a_stream": tokens, "step_ms": step_ms,
                   "offered_tokens_per_s": streams * 1e3 / step_ms,
                   "machine": f"{platform.machine()}, {mp.cpu_count()} cores",
                   "engine_core": str(Path(engine_core.__file__).parent),
                   "date": time.strftime("%Y-%m-%d")})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=400, help="tokens a stream")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the engine's step time")
    parser.add_argument("--out", default=None,
                        help="results JSON (default results/frontend_load/<time>.json)")
    args = parser.parse_args()
    result = measure(args.streams, args.tokens, args.step_ms)
    print(json.dumps(result, indent=2))
    print(f"results in {write_json(args.out or default_out('frontend_load'), result)}")


if __name__ == "__main__":
    main()
