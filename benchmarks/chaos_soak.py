"""Chaos soak: a real cluster under load while its processes are SIGKILLed in a loop.

Why: the cluster promises that kill -9 of any process under load hangs nothing, leaks no KV
and loses no stream (a stream on a dead decode worker continues on another). This runs the
topology that ``pdserve launch`` builds from the arguments after ``--`` (any P/D or placed
shape, CPU or GPU) behind two proxies, A and B (every worker registers with both), with
streamed and whole greedy requests through both, and kills in turn a decode worker, a
prefill worker, a decode worker's engine process and proxy B, restarting each and waiting
until it serves again before the next kill. Every answer is judged against the same
request's answer on the undisturbed cluster. At the end, every worker must hold nothing.

    python3 -m benchmarks.chaos_soak --minutes 60 --out soak.json -- \\
        --prefill 2 --decode 2 --model PATH [--device cpu ...]

The JSON summary: requests, kills by kind, migrations, failures by kind (through A; through
B apart from the clients cut by B's own death), hangs, truncated answers, KV left held, and
each process's memory (first and last sample of its latest incarnation). ``tests/integration/
test_chaos.py`` runs the same loop until each kind was killed once.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.chaos_cluster import ClusterSettings, SoakCluster, held_kv, http_get
from benchmarks.chaos_requests import Answer, Probe, judge, probes, send
from benchmarks.output import default_out, write_json
from benchmarks.serve.prometheus import counter, scrape
from deploy.launch import Child

KILL_KINDS = ("decode", "prefill", "engine", "proxy")
PROXY_B_OUTAGE = "proxy_b_outage"
REGISTRATION_GRACE_S = 5.0  # a restarted proxy B has every worker registered again within


@dataclass
class SoakSettings:
    """What to run: the cluster, how long, how hard."""

    cluster: ClusterSettings
    duration_s: float
    concurrency: int = 6  # clients per proxy
    pause_s: float = 2.0  # load between two kills
    client_timeout_s: float = 120.0  # far past any request's time: reaching it is a hang
    startup_s: float = 300.0
    min_kills: int = len(KILL_KINDS)  # one of each kind, however long that takes


def migrations(url: str) -> float:
    """Requests the proxy at ``url`` moved to another worker so far."""
    return counter(scrape(url), "pdserve:proxy_migrations")


class ChaosLoop:
    """Kills in turn and restarts each victim at once, waiting for it to serve on a thread
    of its own, so the next kill need not wait for a slow worker start; a kill is held back
    only while it would leave its role with no serving worker (a stream on a killed D needs
    another D to move to). Runs on the thread that started the cluster: a child is killed
    when the thread that started it ends (``die_with_parent``), so none starts elsewhere."""

    def __init__(self, cluster: SoakCluster, settings: SoakSettings) -> None:
        self._cluster = cluster
        self._settings = settings
        self._restarting: dict[str, concurrent.futures.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(len(cluster.children),
                                                           thread_name_prefix="restart")
        self._turn: Counter = Counter()
        self.kills: Counter = Counter()
        self.moved_before_kill = 0.0  # proxy B's migrations, read before each of its deaths
        # (killed, serving again) times of proxy B: its clients are cut or refused then.
        self.proxy_b_outages: list[tuple[float, float]] = []

    def run(self, stop_at: float) -> None:
        """Until ``stop_at`` and at least ``min_kills`` kills; every victim serving again."""
        try:
            while (time.monotonic() < stop_at
                   or sum(self.kills.values()) < self._settings.min_kills):
                kind = KILL_KINDS[sum(self.kills.values()) % len(KILL_KINDS)]
                victim = self._next_victim(kind)
                if victim is None:
                    if not self._cluster.victims(kind):
                        raise RuntimeError(f"this topology has nothing to kill as {kind!r}")
                    self._wait_one_restart()
                    continue
                time.sleep(self._settings.pause_s)
                self._cluster.sample_all()
                if victim is self._cluster.proxy_b:  # its counters die with it
                    self.moved_before_kill += migrations(self._cluster.url_b)
                killed_at = time.monotonic()
                self._cluster.kill(kind, victim)
                self.kills[kind] += 1
                victim.start()
                self._restarting[victim.name] = self._pool.submit(
                    self._wait_serving, victim, killed_at)
            while self._restarting:
                self._wait_one_restart()
        finally:
            self._pool.shutdown(wait=True)

    def _next_victim(self, kind: str) -> Child | None:
        victims = [v for v in self._cluster.victims(kind) if v.name not in self._restarting]
        if kind != "proxy":  # another worker of the role must serve while this one is down
            peers = self._cluster.victims(kind)
            victims = [v for v in victims
                       if any(p is not v and p.name not in self._restarting for p in peers)]
        if not victims:
            return None
        self._turn[kind] += 1
        return victims[self._turn[kind] % len(victims)]

    def _wait_serving(self, victim: Child, killed_at: float) -> None:
        self._cluster.wait_serving(victim, self._settings.startup_s,
                                   down=lambda: set(self._restarting) - {victim.name})
        if victim is self._cluster.proxy_b:
            self.proxy_b_outages.append((killed_at, time.monotonic()))

    def _wait_one_restart(self) -> None:
        done, _ = concurrent.futures.wait(list(self._restarting.values()),
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        for name, future in list(self._restarting.items()):
            if future in done:
                del self._restarting[name]
                future.result()  # a victim that never served again ends the soak


async def _clients(url: str, reqs: list[Probe], settings: SoakSettings,
                   stop: threading.Event, results: list[tuple[int, Answer]],
                   first: int = 0) -> None:
    """``concurrency`` clients sending ``reqs`` round and round, from ``first`` on, until
    ``stop``; each answer recorded with its request's index."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(offset: int) -> None:
            i = first + offset
            while not stop.is_set():
                index = i % len(reqs)
                answer = await send(session, url, reqs[index], settings.client_timeout_s)
                results.append((index, answer))
                if answer.exception is not None or answer.status != 200:  # no busy loop
                    await asyncio.sleep(0.2)
                i += settings.concurrency

        await asyncio.gather(*(client(k) for k in range(settings.concurrency)))


def _run(cluster: SoakCluster, settings: SoakSettings, reqs: list[Probe]
         ) -> tuple[list[tuple[int, Answer]], list[tuple[int, Answer]], ChaosLoop, float]:
    """The load on a thread of its own, the kills on this one (see ``ChaosLoop``)."""
    stop = threading.Event()
    through_a: list[tuple[int, Answer]] = []
    through_b: list[tuple[int, Answer]] = []

    async def load() -> None:
        await asyncio.gather(_clients(cluster.url_a, reqs, settings, stop, through_a),
                             _clients(cluster.url_b, reqs, settings, stop, through_b,
                                      first=len(reqs) // 2))

    loader = threading.Thread(target=asyncio.run, args=(load(),), name="soak-load")
    loader.start()
    chaos = ChaosLoop(cluster, settings)
    try:
        chaos.run(time.monotonic() + settings.duration_s)
        time.sleep(settings.pause_s)
    finally:
        stop.set()
        loader.join()
    moved = chaos.moved_before_kill + migrations(cluster.url_a) + migrations(cluster.url_b)
    return through_a, through_b, chaos, moved


def _judge_b(answer: Answer, reference: Answer, outages: list[tuple[float, float]]) -> str:
    """``judge``, except that B's clients cut, or refused (503) before the workers registered
    again, while B was down or just back count as ``PROXY_B_OUTAGE``: seen by the client,
    never a short 200."""
    verdict = judge(answer, reference)
    if verdict in ("cut", "http_503") and any(
            answer.started <= back + REGISTRATION_GRACE_S and answer.ended >= killed
            for killed, back in outages):
        return PROXY_B_OUTAGE
    return verdict


def _reference(url: str, reqs: list[Probe], timeout_s: float) -> list[Answer]:
    async def all_once() -> list[Answer]:
        async with aiohttp.ClientSession() as session:
            return [await send(session, url, r, timeout_s) for r in reqs]

    want = asyncio.run(all_once())
    bad = [a for a in want if judge(a, a) != "ok"]
    if bad:
        raise RuntimeError(f"the undisturbed cluster failed requests: {bad[:3]}")
    return want


def wait_idle(cluster: SoakCluster, deadline_s: float) -> dict[str, list[str]]:
    """Each worker's idle gauges that still do not read 0 after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while True:
        held = {}
        for worker in cluster.workers:
            try:
                held[worker.name] = held_kv(scrape(f"http://{worker.http_address}"))
            except OSError as exc:
                held[worker.name] = [f"/metrics unreadable: {exc}"]
        held = {name: gauges for name, gauges in held.items() if gauges}
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def run_soak(settings: SoakSettings) -> dict[str, Any]:
    """Build, start, soak, judge and stop the cluster; the summary."""
    cluster = SoakCluster.build(settings.cluster)
    started = time.monotonic()
    try:
        cluster.start(settings.startup_s)
        model = json.loads(http_get(f"{cluster.url_a}/v1/models"))["data"][0]["id"]
        reqs = probes(model)
        want = _reference(cluster.url_a, reqs, settings.client_timeout_s)
        through_a, through_b, chaos, moved = _run(cluster, settings, reqs)
        held = wait_idle(cluster, 60.0)
        cluster.sample_all()
    finally:
        cluster.stop()
    verdict_a = Counter(judge(answer, want[i]) for i, answer in through_a)
    verdict_b = Counter(_judge_b(answer, want[i], chaos.proxy_b_outages)
                        for i, answer in through_b)
    outage_b = verdict_b.pop(PROXY_B_OUTAGE, 0)
    failures = {f"a_{k}": n for k, n in verdict_a.items() if k != "ok"}
    failures |= {f"b_{k}": n for k, n in verdict_b.items() if k != "ok"}
    return {
        "launch_argv": settings.cluster.launch_argv,
        "seconds": round(time.monotonic() - started, 1),
        "requests": {"through_a": len(through_a), "through_b": len(through_b),
                     "ok": verdict_a["ok"] + verdict_b["ok"]},
        "kills": dict(chaos.kills),
        "migrations": moved,
        "failures": failures,
        "proxy_b_outage": outage_b,
        "hangs": verdict_a["hang"] + verdict_b["hang"],
        "truncated": verdict_a["truncated"] + verdict_b["truncated"],
        "leaked_kv": held,
        "memory_mb": {name: {k: (round(v, 1) if v is not None else None)
                             for k, v in asdict(track).items()}
                      for name, track in sorted(cluster.memory.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="%(prog)s [options] -- LAUNCH_ARGS")
    parser.add_argument("--minutes", type=float, default=60.0, help="how long to kill")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON summary's path (default: results/chaos_soak/<time>.json)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="the processes' logs (default: beside --out)")
    parser.add_argument("--concurrency", type=int, default=6, help="clients per proxy")
    parser.add_argument("launch", nargs=argparse.REMAINDER,
                        help="after --: `pdserve launch` arguments (topology, model, device)")
    args = parser.parse_args()
    launch = args.launch[1:] if args.launch[:1] == ["--"] else args.launch
    out = args.out or default_out("chaos_soak")
    log_dir = args.log_dir or out.with_suffix(".logs")
    summary = run_soak(SoakSettings(ClusterSettings(launch, log_dir), args.minutes * 60,
                                    concurrency=args.concurrency))
    write_json(out, summary)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
