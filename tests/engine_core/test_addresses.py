"""``check_distinct_ports``: two listeners never get one port."""

from __future__ import annotations

import pytest

from engine_core.addresses import check_distinct_ports
from engine_core.errors import ConfigError


def test_distinct_ports_pass_and_unassigned_ones_are_ignored() -> None:
    check_distinct_ports({"--port": 10001, "--registration-port": 30001})
    check_distinct_ports({"--port": 10001, "--registration-port": None, "--kv-port": None})
    check_distinct_ports({"--port": 0, "--registration-port": 0})  # 0: the OS picks each


def test_a_port_given_twice_names_both_flags() -> None:
    with pytest.raises(ConfigError, match="--port and --kv-port are both 9000"):
        check_distinct_ports({"--port": 9000, "--registration-port": 9001, "--kv-port": 9000})
