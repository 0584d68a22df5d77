"""Runs a benchmark: prompts, warm-up, paced requests, metrics; one result dict per rate.

In a sweep (several ``--request-rate`` values) point ``i`` draws its prompts with seed
``seed + i``: a server's prefix cache never turns a repeated prompt into hits, and two
servers benchmarked with the same flags still get the same prompts at every point.
Warm-up and readiness requests use prompts of their own seed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import aiohttp

from benchmarks.serve.breakdown import summarize_stages
from benchmarks.serve.client import (
    RequestOutput,
    build_payload,
    count_output_tokens,
    send_request,
)
from benchmarks.serve.config import BenchConfig
from benchmarks.serve.datasets import (
    SampleRequest,
    as_text,
    load_tokenizer,
    resolve_tokenizer_path,
    sample_requests,
)
from benchmarks.serve.metrics import compute_metrics, request_tpot, summarize_errors
from benchmarks.serve.traffic import arrival_offsets, paced

logger = logging.getLogger("pdserve.bench")

WARMUP_SEED_OFFSET = 1_000_003


class BenchmarkError(RuntimeError):
    """The benchmark could not run (server not ready, bad model, no tokenizer)."""


def _progress(total: int, disable: bool, desc: str) -> Any:
    if disable:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req")


def _headers(config: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


async def resolve_model(session: aiohttp.ClientSession, config: BenchConfig) -> str:
    """The name sent in requests: ``--served-model-name``, ``--model`` or the server's first."""
    if config.served_model_name or config.model:
        return config.served_model_name or config.model
    url = config.base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, headers=_headers(config)) as response:
            data = await response.json()
        return data["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, KeyError, IndexError,
            ValueError) as exc:
        raise BenchmarkError(f"cannot read the model name from {url} ({exc}); "
                             "give --model") from None


@dataclasses.dataclass
class _Prepared:
    """Request bodies built before the clock starts (decoding chat text costs time)."""

    payloads: list[dict[str, Any]]
    prompt_lens: list[int]


def _prepare(config: BenchConfig, model: str, requests: Sequence[SampleRequest],
             tokenizer: Any) -> _Prepared:
    payloads = [build_payload(model, r, config.chat, config.ignore_eos, config.temperature,
                              as_text(r, tokenizer) if config.chat else None)
                for r in requests]
    return _Prepared(payloads, [r.prompt_len for r in requests])


async def _ready_check(session: aiohttp.ClientSession, config: BenchConfig,
                       prepared: _Prepared) -> None:
    """Send the first warm-up prompt until it succeeds; a 4xx answer ends it at once."""
    deadline = time.monotonic() + config.ready_check_timeout_s
    while True:
        out = await send_request(session, config.url, prepared.payloads[0],
                                 prepared.prompt_lens[0],
                                 {**_headers(config), "X-Request-Id": f"{config.request_id_prefix}ready"})
        if out.success:
            return
        if (out.status is not None and 400 <= out.status < 500) or time.monotonic() > deadline:
            raise BenchmarkError(f"the first request to {config.url} failed: {out.error}")
        await asyncio.sleep(1.0)


async def send_all(session: aiohttp.ClientSession, config: BenchConfig, prepared: _Prepared,
                   rate: float, seed: int, id_prefix: str,
                   on_done: Callable[[], None] | None = None
                   ) -> tuple[list[RequestOutput], float]:
    """Send every prepared request at its arrival time; (outputs in order, duration s)."""
    n = len(prepared.payloads)
    offsets = arrival_offsets(n, rate, config.burstiness, seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    base_headers = _headers(config)
    start = time.perf_counter()

    async def one(index: int) -> RequestOutput:
        headers = {**base_headers, "X-Request-Id": f"{id_prefix}{index}"}
        url = config.url_for(index)
        try:
            if limit is None:
                return await send_request(session, url, prepared.payloads[index],
                                          prepared.prompt_lens[index], headers, start)
            async with limit:
                return await send_request(session, url, prepared.payloads[index],
                                          prepared.prompt_lens[index], headers, start)
        finally:
            if on_done is not None:
                on_done()

    tasks = [asyncio.create_task(one(i)) async for i in paced(range(n), offsets, start)]
    outputs = await asyncio.gather(*tasks)
    return list(outputs), time.perf_counter() - start


def _result(config: BenchConfig, model: str, tokenizer_id: str | None, rate: float, seed: int,
            outputs: list[RequestOutput], duration_s: float) -> dict[str, Any]:
    done = [o for o in outputs if o.success]
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": config.label,
        "backend": "openai-chat" if config.chat else "openai",
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "dataset_name": config.dataset.name,
        "num_prompts": len(outputs),
        "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "seed": seed,
        "ignore_eos": config.ignore_eos,
        "goodput_slos_ms": dict(config.goodput),
        "percentiles": list(config.metric_percentiles),
        **config.metadata,
    }
    result.update(compute_metrics(outputs, duration_s, config.percentile_metrics,
                                  config.metric_percentiles, config.goodput))
    if config.interleave_base_url is not None:
        # Each target's requests alone (even: base_url, odd: the interleaved one).
        result["interleaved"] = {
            name: compute_metrics(outputs[first::2], duration_s, config.percentile_metrics,
                                  config.metric_percentiles, config.goodput)
            for name, first in (("base", 0), ("interleaved", 1))}
        result["interleave_base_url"] = config.interleave_base_url
    result["server_breakdown"] = summarize_stages([o.server for o in done])
    result["errors"] = summarize_errors(outputs)
    result["input_lens"] = [o.prompt_len for o in done]
    result["output_lens"] = [o.output_tokens for o in done]
    result["ttfts"] = [o.ttft for o in done]
    result["tpots"] = [request_tpot(o) for o in done]
    result["e2els"] = [o.latency for o in done]
    if config.save_detailed:
        result["itls"] = [o.itl for o in done]
        result["start_offsets"] = [o.start_offset for o in outputs]
        result["request_errors"] = [o.error for o in outputs]
        result["server_stages"] = [o.server for o in done]
    return result


async def _run_all(config: BenchConfig, tokenizer: Any) -> list[dict[str, Any]]:
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = await resolve_model(session, config)
        tokenizer_id = resolve_tokenizer_path(config.tokenizer, config.model or model)
        logger.info("requesting model %s (tokenizer %s)", model, tokenizer_id or "none")
        if tokenizer is None and tokenizer_id is not None:
            tokenizer = load_tokenizer(tokenizer_id)
        warm_config = dataclasses.replace(
            config.dataset, seed=config.dataset.seed + WARMUP_SEED_OFFSET,
            num_prompts=max(1, config.num_warmups))
        warm = _prepare(config, model, sample_requests(warm_config, tokenizer), tokenizer)
        if config.ready_check_timeout_s > 0:
            await _ready_check(session, config, warm)
        if config.num_warmups:
            await send_all(session, config, warm, math.inf, 0, f"{config.request_id_prefix}warm-")
        results = []
        for index, rate in enumerate(config.request_rates):
            seed = config.dataset.seed + index
            dataset = dataclasses.replace(config.dataset, seed=seed)
            prepared = _prepare(config, model, sample_requests(dataset, tokenizer), tokenizer)
            bar = _progress(len(prepared.payloads), config.disable_tqdm,
                            f"{config.label or 'bench'} @ {rate:g} req/s")
            outputs, duration = await send_all(
                session, config, prepared, rate, seed, f"{config.request_id_prefix}{index}-",
                on_done=bar.update if bar is not None else None)
            if bar is not None:
                bar.close()
            count_output_tokens(outputs, tokenizer)
            results.append(_result(config, model, tokenizer_id, rate, seed, outputs, duration))
        return results


def run_benchmark(config: BenchConfig, tokenizer: Any = None) -> list[dict[str, Any]]:
    """Run every request rate of ``config``; the tokenizer is loaded when not given."""
    try:
        return asyncio.run(_run_all(config, tokenizer))
    except ValueError as exc:  # dataset problems (no tokenizer, bad path)
        raise BenchmarkError(str(exc)) from None
