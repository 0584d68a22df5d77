"""What a cluster did during one sweep point: the proxy's placement decisions (counter
deltas by placement and reason), each worker's load and the proxy's lane plan, sampled from
``/instances`` while the point runs. Written into the point's raw JSON so a losing cell can be explained."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections import Counter
from typing import Any

PLACEMENTS = re.compile(r'^pdserve:proxy_placements_total\{([^}]*)\}\s+([0-9.eE+-]+)$')
LOAD_FIELDS = ("num_running", "num_decoding", "num_waiting", "num_waiting_for_remote_kv",
               "num_prefill_tokens_queued", "prefill_tokens_per_s", "prefill_alone_tokens_per_s",
               "decode_step_s", "decode_base_s", "decode_hidden_s", "decode_per_row_s",
               "kv_cache_usage")


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=3.0) as response:
        return response.read()


def placement_counts(base_url: str) -> Counter:
    """The proxy's placements so far, keyed ``placement/reason``."""
    counts: Counter = Counter()
    for line in _get(f"{base_url}/metrics").decode().splitlines():
        match = PLACEMENTS.match(line)
        if match:
            labels = dict(item.split("=", 1) for item in match.group(1).split(","))
            key = "/".join(labels.get(k, "").strip('"') for k in ("placement", "reason"))
            counts[key] += float(match.group(2))
    return counts


class PointObserver:
    """``with PointObserver(url) as seen: ...``; then ``seen.record()``: placement deltas and
    one load row per worker per ``interval_s``."""

    def __init__(self, base_url: str, interval_s: float = 0.5) -> None:
        self.base_url = base_url
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._before: Counter = Counter()
        self._after: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PointObserver:
        self._before = self._safe_counts()
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._after = self._safe_counts()

    def record(self) -> dict[str, Any]:
        delta = {k: v - self._before.get(k, 0.0) for k, v in self._after.items()
                 if v - self._before.get(k, 0.0) > 0}
        return {"placements": delta, "load_samples": self.samples}

    def _safe_counts(self) -> Counter:
        try:
            return placement_counts(self.base_url)
        except (OSError, ValueError):
            return Counter()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                instances = json.loads(_get(f"{self.base_url}/instances"))
                workers = instances["workers"]
            except (OSError, ValueError, KeyError):
                continue
            t = round(time.monotonic() - self._started, 2)
            self.samples.append({"t": t, "lanes": instances.get("lanes")})
            for worker in workers:
                load = worker.get("load", {})
                row = {"t": t, "worker": worker.get("http_address"),
                       "pending": worker.get("pending_prefill_tokens"),
                       "in_flight": worker.get("role_mix", {}).get("in_flight")}
                row.update({k: load.get(k) for k in LOAD_FIELDS})
                self.samples.append(row)
