"""A worker's heartbeat load carries every placement input of its engine's stats."""

from __future__ import annotations

import dataclasses

from engine_core.cluster.messages import WorkerLoad
from engine_core.messages import EngineStats
from engine_core.server.worker import worker_load


def test_every_shared_field_reaches_the_heartbeat() -> None:
    shared = [f for f in dataclasses.fields(WorkerLoad) if f.name != "sleeping"]
    values = {}
    for number, field in enumerate(shared, start=1):
        # Distinct values, each valid for its field (usage is a fraction).
        values[field.name] = number / 100 if field.type in ("float", float) else number
    required = {f.name: 0 for f in dataclasses.fields(EngineStats)
                if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING and f.name not in values}
    stats = EngineStats(**values, **required, sleep_level=2)
    load = worker_load(stats)
    assert {name: getattr(load, name) for name in values} == values
    assert load.sleeping
    assert worker_load(None) == WorkerLoad()
    assert not worker_load(dataclasses.replace(stats, sleep_level=0)).sleeping
