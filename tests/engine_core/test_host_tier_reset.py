"""A prefix-cache reset while host-offload downloads are in flight (on a GPU they land
asynchronously): the reset must forget those blocks too, and their slots come back once the
copies land."""

from __future__ import annotations

from engine_core.sched.host_tier import HostTier


def _hash(i: int):  # BlockHash is an opaque hashable; the tier never looks inside
    return ("block", i)


def test_reset_forgets_blocks_whose_download_is_in_flight() -> None:
    tier = HostTier(4)
    landed, in_flight = tier.store(_hash(1)), tier.store(_hash(2))
    assert landed is not None and in_flight is not None
    tier.landed([landed])
    tier.clear()
    tier.check_integrity()
    assert tier.lookup(_hash(1)) is None
    # Still being written: neither served nor reused before it lands...
    assert len(tier) == 0
    slots = [tier.store(_hash(10 + i)) for i in range(3)]
    assert in_flight not in slots and None not in slots
    assert tier.store(_hash(20)) is None  # the fourth slot is still the in-flight copy's
    tier.landed([in_flight])
    tier.check_integrity()
    # ...and after it lands it is not served (the reset forgot it) but free again.
    assert tier.lookup(_hash(2)) is None
    assert tier.store(_hash(21)) == in_flight
    tier.check_integrity()
