"""Rank 0's report channel: the ranks' ``RankReport`` s reach its connector, a malformed or
foreign message is dropped, and a rank that exits is reported lost once."""

from __future__ import annotations

import threading
import time

import zmq

from engine_core.kv_connector import FinishedTransfers
from engine_core.parallel.messages import RANK_CODEC, RankReport, RankStop
from engine_core.parallel.rank_processes import _ReportReceiver


class FakeProcess:
    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


class Recorder:
    rank_factory = "x:y"

    def __init__(self) -> None:
        self.reports: list[tuple[int, FinishedTransfers, dict[str, float]]] = []
        self.lost: list[int] = []

    def rank_shares(self, metadata: object) -> list[bytes | None]:
        return []

    def add_rank_report(self, rank: int, report: FinishedTransfers,
                        stats: dict[str, float], idle: bool) -> None:
        self.reports.append((rank, report, stats))

    def rank_lost(self, rank: int) -> None:
        self.lost.append(rank)


def _until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_reports_reach_the_connector_and_a_lost_rank_is_told_once() -> None:
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    processes = [FakeProcess(), FakeProcess()]
    connector = Recorder()
    stopping = threading.Event()
    receiver = _ReportReceiver(pull, processes, connector, stopping)  # type: ignore[arg-type]
    receiver.start()
    try:
        push.send(b"not msgpack")
        push.send(RANK_CODEC.encode(RankStop()))  # not a report
        push.send(RANK_CODEC.encode(RankReport(7, recving=["a"])))  # no such rank
        push.send(RANK_CODEC.encode(RankReport(2, sending=["s"], recving=["a"],
                                               connector_stats={"bytes_sent": 3.0})))
        assert _until(lambda: connector.reports)
        assert connector.reports == [(2, FinishedTransfers({"s"}, {"a"}, set()),
                                      {"bytes_sent": 3.0})]
        processes[0].code = -9
        assert _until(lambda: connector.lost)
        push.send(RANK_CODEC.encode(RankReport(1, recving=["late"])))  # from the lost rank
        time.sleep(0.3)
        assert connector.lost == [1] and len(connector.reports) == 1
    finally:
        stopping.set()
        receiver.join()
        push.close()
        pull.close()
        context.term()
