"""Rank 0's view of a tensor-parallel worker's transfers: each rank's connector worker reports
what it finished, and a request is reported to the scheduler once every rank it involves has
ended its part. Pure: no device, socket or thread.

A consumer request lands only when every rank that loads part of its heads has landed, and
fails when any of them failed, but never before every one ended (a rank still loading may
write the request's blocks, which a failure frees). A producer request's held blocks are
handed back once every rank that sends part of it has sent or given up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.kv_connector import FinishedTransfers


@dataclass
class _Pending:
    """The ranks a request still waits on, and whether any of them failed."""

    waiting: set[int]
    failed: bool = False


@dataclass
class RankReportCombiner:
    """Combines per-rank ``FinishedTransfers`` into the worker's. ``expect_*`` names the
    ranks a request involves (from the step's split); a report for a request that was never
    expected counts as from its only rank, as a TP=1 worker reports it."""

    _loads: dict[str, _Pending] = field(default_factory=dict)
    _sends: dict[str, _Pending] = field(default_factory=dict)

    def expect_load(self, request_id: str, ranks: frozenset[int]) -> None:
        self._loads[request_id] = _Pending(set(ranks))

    def expect_send(self, request_id: str, ranks: frozenset[int]) -> None:
        self._sends[request_id] = _Pending(set(ranks))

    def add(self, rank: int, report: FinishedTransfers) -> FinishedTransfers:
        """Take one rank's report; return the requests that ended on every rank by now."""
        done = FinishedTransfers()
        for request_id in report.sending:
            if self._end(self._sends, request_id, rank, failed=False) is not None:
                done.sending.add(request_id)
        for request_id, failed in ([(r, False) for r in report.recving]
                                   + [(r, True) for r in report.failed_recving]):
            outcome = self._end(self._loads, request_id, rank, failed)
            if outcome is True:
                done.failed_recving.add(request_id)
            elif outcome is False:
                done.recving.add(request_id)
        return done

    def drop_rank(self, rank: int) -> FinishedTransfers:
        """``rank`` is gone: it ends every request still waiting on it (its loads failed,
        its sends given up); returns the requests that ended on every rank by now."""
        report = FinishedTransfers(
            sending={r for r, p in self._sends.items() if rank in p.waiting},
            failed_recving={r for r, p in self._loads.items() if rank in p.waiting})
        return self.add(rank, report)

    def forget(self, request_id: str) -> None:
        """Drop a request no rank will report any more (its load was cancelled everywhere)."""
        self._loads.pop(request_id, None)
        self._sends.pop(request_id, None)

    @property
    def pending(self) -> int:
        """Requests some rank has not reported yet."""
        return len(self._loads) + len(self._sends)

    @staticmethod
    def _end(table: dict[str, _Pending], request_id: str, rank: int,
             failed: bool) -> bool | None:
        """Mark ``rank`` done with ``request_id``: the request's outcome (True: failed)
        once no rank is left, else None."""
        pending = table.get(request_id)
        if pending is None:
            return failed
        pending.waiting.discard(rank)
        pending.failed = pending.failed or failed
        if pending.waiting:
            return None
        del table[request_id]
        return pending.failed
