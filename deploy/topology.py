"""``pdserve launch``'s workers: how many of each kind it starts, in which order."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DEFAULT_WORKERS = 2


@dataclass(frozen=True)
class Topology:
    """How many workers of each kind launch starts."""

    prefill: int
    decode: int
    workers: int
    colocated: int

    def connector_kinds(self) -> list[tuple[str, int]]:
        """(kind, index within it) of every worker with a KV connector, in start order."""
        return ([("prefill", i) for i in range(self.prefill)]
                + [("decode", i) for i in range(self.decode)]
                + [("worker", i) for i in range(self.workers)])

    def worker_kinds(self) -> list[str]:
        """The kind of every worker in start order: the connector workers, then the
        colocated ones."""
        return [kind for kind, _ in self.connector_kinds()] + ["colocated"] * self.colocated

    def describe(self) -> str:
        parts = ([f"{self.workers} workers"] if self.workers else []) + (
            [f"{self.prefill}P{self.decode}D"] if self.prefill or self.decode else []) + (
            [f"{self.colocated} colocated"] if self.colocated else [])
        return " + ".join(parts)


def topology(args: argparse.Namespace) -> Topology:
    """The launch's workers: --prefill/--decode pin static roles (the one not given is 1);
    without them --workers (default ``DEFAULT_WORKERS``, or 0 beside --colocated) start
    workers the proxy places requests on. Both kinds may run together: the static ones
    then join the placement with their role's capabilities."""
    if args.prefill is None and args.decode is None:
        workers = args.workers if args.workers is not None else (
            0 if args.colocated else DEFAULT_WORKERS)
        return Topology(0, 0, workers, args.colocated)
    prefill, decode = (1 if n is None else n for n in (args.prefill, args.decode))
    return Topology(prefill, decode, args.workers or 0, args.colocated)
