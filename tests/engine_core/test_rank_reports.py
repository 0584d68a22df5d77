"""Rank 0 combining its ranks' transfer reports (pure)."""

from __future__ import annotations

from engine_core.kv_connector import FinishedTransfers
from engine_core.parallel.rank_reports import RankReportCombiner


def recv(*ids: str) -> FinishedTransfers:
    return FinishedTransfers(recving=set(ids))


def test_load_lands_only_when_every_rank_landed() -> None:
    combiner = RankReportCombiner()
    combiner.expect_load("a", frozenset({0, 1}))
    assert combiner.add(0, recv("a")) == FinishedTransfers()
    assert combiner.pending == 1
    assert combiner.add(1, recv("a")) == FinishedTransfers(recving={"a"})
    assert combiner.pending == 0


def test_one_failed_rank_fails_the_load_after_every_rank_ended() -> None:
    combiner = RankReportCombiner()
    combiner.expect_load("a", frozenset({0, 1, 2}))
    assert combiner.add(1, FinishedTransfers(failed_recving={"a"})) == FinishedTransfers()
    assert combiner.add(0, recv("a")) == FinishedTransfers()  # rank 2 may still write
    assert combiner.add(2, recv("a")) == FinishedTransfers(failed_recving={"a"})


def test_sends_end_when_every_sending_rank_reported() -> None:
    combiner = RankReportCombiner()
    combiner.expect_send("p", frozenset({0, 2}))
    assert combiner.add(2, FinishedTransfers(sending={"p"})) == FinishedTransfers()
    assert combiner.add(0, FinishedTransfers(sending={"p"})) == FinishedTransfers(sending={"p"})


def test_unexpected_report_passes_through_and_forget_drops() -> None:
    combiner = RankReportCombiner()
    assert combiner.add(0, recv("solo")) == recv("solo")
    combiner.expect_load("gone", frozenset({0, 1}))
    combiner.forget("gone")
    assert combiner.pending == 0


def test_a_lost_rank_fails_its_loads_and_ends_its_sends() -> None:
    combiner = RankReportCombiner()
    combiner.expect_load("a", frozenset({0, 1}))
    combiner.expect_load("b", frozenset({0}))
    combiner.expect_send("s", frozenset({1}))
    assert combiner.add(0, recv("a")) == FinishedTransfers()
    assert combiner.drop_rank(1) == FinishedTransfers(sending={"s"}, failed_recving={"a"})
    assert combiner.pending == 1  # "b" never waited on rank 1
