"""ProxyConfig: every proxy knob, frozen, built once by the CLI."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine_core.addresses import check_distinct_ports
from engine_core.cluster.trust import ClusterSecret
from engine_core.errors import ConfigError
from engine_core.server.http_runner import DEFAULT_HEADER_TIMEOUT_S
from proxy.placement import PlacementConfig
from proxy.registry import DEFAULT_MAX_WORKERS
from proxy.routing import POLICIES


@dataclass(frozen=True)
class ProxyConfig:
    """Settings of one proxy process (flag names in ``proxy.__main__``)."""

    host: str = "127.0.0.1"
    port: int = 10001
    registration_host: str | None = None  # None: same as host
    registration_port: int | None = 30001  # None: no registration server (tests)
    heartbeat_timeout_s: float = 10.0
    routing: str = "round_robin"
    affinity_prefix_chars: int = 256    # prefix_affinity: how much of the prompt keys a route
    affinity_max_imbalance: float = 8.0  # prefix_affinity: load gap that overrides affinity
    max_inflight: int = 1024
    max_body_bytes: int = 16 << 20
    # Seconds a client may take to send its whole body (408 beyond): the body is read while
    # the request holds an admission slot, so a stalled upload must not hold it for good.
    body_timeout_s: float = 30.0
    # Seconds a client may take to send a request line and headers (408 and closed beyond).
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    # Clients must send it as a bearer token on every route but /health, /ping and /ready;
    # the proxy sends it to the workers (one key for the cluster). None: no key.
    api_key: str | None = field(default=None, repr=False)
    max_response_bytes: int = 64 << 20
    # Seconds one write to a streaming client may wait for it to take the bytes: one that
    # stops reading while connected would otherwise hold its slot and D's leg for good.
    write_timeout_s: float = 60.0
    prefill_timeout_s: float = 120.0
    decode_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    max_attempts: int = 3
    # Request migration (proxy/migration.py): moves per request after decode legs failed;
    # the first-event deadline of a streamed decode leg (None: from the TTFT target) and the
    # deadline between its events.
    migration_limit: int = 3
    first_byte_timeout_s: float | None = None
    stall_timeout_s: float = 30.0
    suspect_s: float = 5.0
    # Stream P's sampled token at once and let D continue after it (else D computes it).
    first_token_from_prefill: bool = True
    # Prefill legs in flight on every P from which D prefills a request itself (0: never).
    prefill_overflow: int = 0
    # Placement over workers with capabilities (proxy/placement.py): the operator's targets,
    # the prompt size that always stays where it decodes.
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 20.0
    placement_short_prompt_tokens: int = 256
    max_workers: int = DEFAULT_MAX_WORKERS  # registrations beyond are refused
    # Authenticates registrations and signs transfer grants; none: loopback or --insecure.
    cluster_secret: ClusterSecret = ClusterSecret()
    insecure: bool = False  # bind a non-loopback address without a cluster secret

    def __post_init__(self) -> None:
        if self.routing not in POLICIES:
            raise ConfigError(f"--routing must be one of {sorted(POLICIES)}, got {self.routing!r}")
        if not 0 <= self.affinity_max_imbalance < math.inf:  # NaN fails every comparison
            raise ConfigError("affinity_max_imbalance must be a finite number >= 0")
        if self.prefill_overflow < 0:
            raise ConfigError("prefill_overflow must be >= 0 (0: off)")
        for name in ("max_inflight", "max_body_bytes", "max_response_bytes", "max_attempts",
                     "affinity_prefix_chars", "max_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.migration_limit < 0:
            raise ConfigError("migration_limit must be >= 0 (0: no migration)")
        for name in ("heartbeat_timeout_s", "prefill_timeout_s", "decode_timeout_s",
                     "connect_timeout_s", "body_timeout_s", "write_timeout_s",
                     "header_timeout_s", "stall_timeout_s", "first_byte_deadline_s"):
            if not 0 < getattr(self, name) < math.inf:  # NaN fails every comparison
                raise ConfigError(f"{name} must be a finite number > 0")
        try:
            _ = self.placement
        except ValueError as exc:
            raise ConfigError(f"placement: {exc}") from None
        for name in ("port", "registration_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ConfigError(f"{name} out of range: {value}")
        check_distinct_ports({"--port": self.port, "--registration-port": self.registration_port})

    @property
    def placement(self) -> PlacementConfig:
        """The placement policy's settings."""
        return PlacementConfig(slo_ttft_s=self.slo_ttft_ms / 1e3, slo_tpot_s=self.slo_tpot_ms / 1e3,
                               short_prompt_tokens=self.placement_short_prompt_tokens)

    @property
    def first_byte_deadline_s(self) -> float:
        """The streamed decode leg's first-event deadline: as given, else 30 times the TTFT
        target, at least 30 s (a loaded CPU worker's first token takes seconds)."""
        if self.first_byte_timeout_s is not None:
            return self.first_byte_timeout_s
        return max(30.0, 30 * self.slo_ttft_ms / 1e3)

    @property
    def registration_bind_host(self) -> str:
        """Where the registration server binds."""
        return self.registration_host or self.host
