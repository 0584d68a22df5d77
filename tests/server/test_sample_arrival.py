"""A decode worker's later samples of a prompt wait for sample 0's first token (its KV lands
and is cached by then); their time to first token still counts from the HTTP request's
arrival, as vLLM's child requests share their parent's arrival time. They used to count
from the end of that wait, so a D's TTFT histogram left out the KV transfer for n - 1 of
every n samples."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine_core.demo_model import random_demo_model_path
from engine_core.kv_transfer_params import KVTransferParams
from engine_core.messages import EngineOutput
from engine_core.sampling_params import SamplingParams
from engine_core.server import protocol
from engine_core.server.metrics import ServerMetrics
from engine_core.server.serving import OpenAIServing
from engine_core.server.tokenization import TokenizerService

WAIT_S = 0.3


class _SlowFirstSample:
    """Engine client: sample 0's first token comes after ``WAIT_S`` (its KV transfer);
    every sample then answers one token and finishes."""

    async def generate(self, request_id: str, prompt_token_ids: Any, params: Any,
                       kv_transfer_params: Any = None, generated_token_ids: Any = ()):
        if kv_transfer_params is not None and kv_transfer_params.do_remote_prefill:
            await asyncio.sleep(WAIT_S)
        yield EngineOutput(request_id, [5], len(prompt_token_ids), 0, finish_reason="length")


@pytest.mark.asyncio
async def test_every_sample_counts_its_time_to_first_token_from_the_arrival() -> None:
    tokenizer = TokenizerService.load(str(random_demo_model_path()), 256, 1000)
    metrics = ServerMetrics("demo")
    serving = OpenAIServing(_SlowFirstSample(), tokenizer, ["demo"], metrics)
    transfer = KVTransferParams(transfer_id="t", do_remote_prefill=True,
                                remote_kv_address="127.0.0.1:1")
    jobs = serving._jobs("r", [[1, 2, 3]], SamplingParams(n=3, max_tokens=1), transfer,
                         protocol.Handoff())
    assert [job.after for job in jobs] == [None, 0, 0]
    async for _ in serving._run_jobs(jobs):
        pass
    ttft = metrics.ttft.labels(*metrics._label_values)
    observed = {s.name: s.value for s in ttft.collect()[0].samples
                if s.name.endswith(("_sum", "_count"))}
    assert observed["vllm:time_to_first_token_seconds_count"] == 3
    assert observed["vllm:time_to_first_token_seconds_sum"] >= 3 * WAIT_S * 0.9
    tokenizer.close()


def test_a_decode_workers_vllm_queue_and_prefill_times_mean_what_vllms_do() -> None:
    """vLLM schedules a D request once its KV landed: its queue time spans the KV wait, and
    its prefill time is the first compute step (it had none: the prefill series missed
    every D request, and the queue series read ~0)."""
    metrics = ServerMetrics("demo")
    metrics.observe_breakdown({"queue_ms": 1.0, "kv_wait_ms": 200.0, "decode_queue_ms": 4.0,
                               "first_step_ms": 20.0, "decode_ms": 100.0})
    labels = metrics._label_values

    def total(name: str) -> float:
        histogram = metrics.breakdown[name].labels(*labels)
        return next(s.value for s in histogram.collect()[0].samples if s.name.endswith("_sum"))

    assert total("queue_ms") == pytest.approx(0.205)
    assert total("prefill_ms") == pytest.approx(0.020)
    assert total("kv_wait_ms") == pytest.approx(0.200)
    assert total("first_step_ms") == pytest.approx(0.020)
