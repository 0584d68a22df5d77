"""What the proxy's /v1/models says of each model beyond its name, from the workers.

A worker's own /v1/models card names the checkpoint (``root``), its ``parent`` and its
``max_model_len``; the heartbeat carries none of them, so the proxy asks each registered
worker (again every ``CARD_TTL_S``, and after it re-registers: a restart may change them)
and merges the answers per model. A worker's answer is validated like any network input;
until one answered, the fields read null (as vLLM's optional card fields do when unknown).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from engine_core.cluster.messages import MAX_MODEL_CHARS
from proxy.registry import WorkerState

CARD_TIMEOUT_S = 2.0
CARD_TTL_S = 30.0
MAX_CARD_BYTES = 1 << 20
MAX_ROOT_CHARS = 4096


@dataclass(frozen=True)
class ModelCard:
    """The fields of a worker's card for its model the proxy passes on."""

    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None

    def fields(self) -> dict[str, Any]:
        return {"root": self.root, "parent": self.parent, "max_model_len": self.max_model_len}


def _text(value: Any, max_chars: int) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= max_chars else None


def parse_card(answer: bytes, model: str) -> ModelCard | None:
    """The card of ``model`` in a worker's /v1/models answer; None when it has none."""
    try:
        data = json.loads(answer).get("data")
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(data, list):
        return None
    for entry in data:
        if isinstance(entry, dict) and entry.get("id") == model:
            length = entry.get("max_model_len")
            valid = isinstance(length, int) and not isinstance(length, bool) and length > 0
            return ModelCard(_text(entry.get("root"), MAX_ROOT_CHARS),
                             _text(entry.get("parent"), MAX_MODEL_CHARS),
                             length if valid else None)
    return None


def merge(cards: list[ModelCard]) -> ModelCard:
    """One model's card from its workers' (in registry order): the first root and parent
    given; the smallest max_model_len, the longest request every worker a request may
    cross (P validates it as D does) accepts."""
    lengths = [c.max_model_len for c in cards if c.max_model_len is not None]
    return ModelCard(next((c.root for c in cards if c.root), None),
                     next((c.parent for c in cards if c.parent), None),
                     min(lengths) if lengths else None)


class ModelCards:
    """Cards by worker registration, fetched on demand and asked again after
    ``CARD_TTL_S`` (a worker restarted at its address keeps its registration); a worker
    that does not answer keeps the card it last gave, and is not waited for again before
    the TTL passed (a hung one would hold every /v1/models for ``CARD_TIMEOUT_S``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[tuple[str, float], tuple[ModelCard | None, float]] = {}

    async def cards(self, session: aiohttp.ClientSession, workers: list[WorkerState],
                    headers: dict[str, str]) -> dict[str, ModelCard]:
        """Each model's merged card over ``workers``; the ones not asked lately are asked
        now (concurrently, each within ``CARD_TIMEOUT_S``) with the client's ``headers``."""
        now = self._clock()
        live = {_key(w) for w in workers}
        self._entries = {k: v for k, v in self._entries.items() if k in live}
        due = [w for w in workers if _key(w) not in self._entries
               or now - self._entries[_key(w)][1] > CARD_TTL_S]
        found = await asyncio.gather(*(_fetch(session, w, headers) for w in due))
        for worker, card in zip(due, found, strict=True):
            kept = self._entries.get(_key(worker), (None, now))[0]
            self._entries[_key(worker)] = (card or kept, now)
        by_model: dict[str, list[ModelCard]] = {}
        for worker in workers:
            card = self._entries[_key(worker)][0]
            if card is not None:
                by_model.setdefault(worker.model, []).append(card)
        return {model: merge(cards) for model, cards in by_model.items()}


def _key(worker: WorkerState) -> tuple[str, float]:
    return worker.worker_id, worker.registered_at


async def _fetch(session: aiohttp.ClientSession, worker: WorkerState,
                 headers: dict[str, str]) -> ModelCard | None:
    timeout = aiohttp.ClientTimeout(total=CARD_TIMEOUT_S)
    try:
        async with session.get(worker.url + "/v1/models", headers=headers,
                               timeout=timeout) as response:
            if response.status != 200:
                return None
            answer = await response.content.read(MAX_CARD_BYTES + 1)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None
    if len(answer) > MAX_CARD_BYTES:
        return None
    return parse_card(answer, worker.model)
