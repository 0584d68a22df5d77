"""vLLM's sleep-mode endpoints: POST /sleep?level=N, POST /wake_up, GET /is_sleeping.

Asleep, completions get 503 with an OpenAI error body; woken, the same request gives the
same greedy text as before; bad levels get 400; the endpoints need the admin switch.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from engine_core.config import CacheConfig, EngineConfig, ModelConfig
from tests.server.conftest import ServerHandle

BODY = json.dumps({"prompt": "sleep well", "max_tokens": 6, "temperature": 0,
                   "ignore_eos": True}).encode()


def _post(url: str, data: bytes = b"") -> tuple[int, dict | None]:
    request = urllib.request.Request(url, method="POST", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _sleep_level_metric(url: str) -> float:
    """``pdserve:engine_sleep_level`` from /metrics (what heartbeats to the proxy carry)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("pdserve:engine_sleep_level{")]
    return float(line.rsplit(" ", 1)[1])


@pytest.fixture(scope="module")
def sleepy(demo_checkpoint: Path) -> ServerHandle:
    from engine_core.server.api_server import ServerOptions

    config = EngineConfig(model=ModelConfig(model=str(demo_checkpoint), max_model_len=256,
                                            enable_sleep_mode=True),
                          cache=CacheConfig(num_gpu_blocks_override=128))
    handle = ServerHandle(config, ServerOptions(log_stats_interval_s=0,
                                                enable_admin_endpoints=True))
    yield handle
    handle.stop()


def test_sleep_wake_round_trip(sleepy: ServerHandle) -> None:
    url = sleepy.url
    status, before = _post(f"{url}/v1/completions", BODY)
    assert status == 200
    assert _get(f"{url}/is_sleeping") == {"is_sleeping": False}
    assert _sleep_level_metric(url) == 0.0
    assert _post(f"{url}/sleep?level=1")[0] == 200
    # The engine pushed its stats ahead of the call's result: what the proxy heartbeat reads
    # (the pushed stats, not a fresh query) says asleep before the caller hears back.
    assert sleepy.client.latest_stats.sleep_level == 1
    assert _sleep_level_metric(url) == 1.0
    assert _get(f"{url}/is_sleeping") == {"is_sleeping": True}
    status, body = _post(f"{url}/v1/completions", BODY)
    assert status == 503 and "asleep" in body["error"]["message"], body
    assert _post(f"{url}/wake_up")[0] == 200
    assert sleepy.client.latest_stats.sleep_level == 0
    assert _sleep_level_metric(url) == 0.0
    assert _get(f"{url}/is_sleeping") == {"is_sleeping": False}
    status, after = _post(f"{url}/v1/completions", BODY)
    assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
    assert _post(f"{url}/sleep?level=2")[0] == 200
    assert _post(f"{url}/wake_up")[0] == 200
    status, again = _post(f"{url}/v1/completions", BODY)
    assert status == 200 and again["choices"][0]["text"] == before["choices"][0]["text"]


@pytest.mark.parametrize("level", ["3", "one"])
def test_bad_level_is_a_400(sleepy: ServerHandle, level: str) -> None:
    status, body = _post(f"{sleepy.url}/sleep?level={level}")
    assert status == 400 and "level" in body["error"]["message"], body
    assert _get(f"{sleepy.url}/is_sleeping") == {"is_sleeping": False}


def test_endpoints_need_the_admin_switch(server: ServerHandle) -> None:
    status, _ = _post(f"{server.url}/sleep?level=1")
    assert status in (401, 404)


def test_staged_wake_up_by_tags(sleepy: ServerHandle) -> None:
    """``/wake_up?tags=weights`` then ``?tags=kv_cache`` (vLLM's): asleep (503s) until both
    are back; an unknown tag is a 400 and wakes nothing."""
    url = sleepy.url
    assert _post(f"{url}/sleep?level=1")[0] == 200
    status, body = _post(f"{url}/wake_up?tags=weights&tags=gpu")
    assert status == 400 and "tags" in body["error"]["message"], body
    assert _post(f"{url}/wake_up?tags=weights")[0] == 200
    assert _get(f"{url}/is_sleeping") == {"is_sleeping": True}
    assert _post(f"{url}/v1/completions", BODY)[0] == 503
    assert _post(f"{url}/wake_up?tags=kv_cache")[0] == 200
    assert _get(f"{url}/is_sleeping") == {"is_sleeping": False}
    assert _post(f"{url}/v1/completions", BODY)[0] == 200
