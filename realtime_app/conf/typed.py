"""The settings as one typed, frozen object: ``REALTIME_APP`` merged over the defaults
(:data:`realtime_app.conf.DEFAULTS`, where each is explained), one attribute per key.

Read it as :func:`realtime_app.conf.runtime.settings` (the process's runtime builds it once
and states the reload rule). Values are the user's, checked by the system checks
(``manage.py check``), not here: a wrong type is reported there, never coerced silently
beyond an int given for a float.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Settings", "bounded", "bounds"]


def bounded(at_least: float, *, at_most: float | None = None) -> Any:
    """A number field's bounds, beside the field: the system check (E002,
    :mod:`realtime_app.checks.configuration`) refuses a value outside them, an int field's
    a non-int too."""
    return field(metadata={"at_least": at_least, "at_most": at_most})


def bounds() -> dict[str, tuple[type, float, float | None]]:
    """Each bounded setting's key: (int or float, at least, at most or None)."""
    found: dict[str, tuple[type, float, float | None]] = {}
    for f in fields(Settings):
        if "at_least" in f.metadata:
            kind = int if f.type == "int" else float
            found[f.name.upper()] = (kind, f.metadata["at_least"], f.metadata["at_most"])
    return found


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Every ``REALTIME_APP`` key, lower-cased (``ADMISSION_MAX_PENDING`` →
    ``admission_max_pending``)."""

    policies: list[Any]
    builtin_policies: list[Any]
    autodiscover_module: str
    max_frame_bytes: int = bounded(0)
    max_batch: int = bounded(1)
    max_channel_name: int = bounded(1)
    max_subscriptions: int = bounded(0)
    backplane: str
    redis_url: str | None
    redis_shards: list[Any] | None
    redis_cluster: list[str] | None
    key_prefix: str
    lease_ttl_ms: int = bounded(300)
    reassert_interval_ms: int = bounded(1000)
    seq_idle_ttl_ms: int = bounded(1000)
    redis_max_connections: int = bounded(2)
    redis_timeout_ms: int = bounded(100)
    backplane_database: str
    postgres_pool_size: int = bounded(1)
    postgres_timeout_ms: int = bounded(100)
    postgres_max_processes: int = bounded(1)
    publish_concurrency: int = bounded(1)
    max_publication_bytes: int = bounded(0)
    max_cadences_per_family: int = bounded(0)
    max_tickers: int = bounded(0)
    max_instances: int = bounded(0)
    max_instances_per_template: int = bounded(0)
    max_tickers_per_identity: int = bounded(0)
    max_instances_per_identity: int = bounded(0)
    max_backplane_bytes_per_identity: int = bounded(0)
    max_connections_per_user: int = bounded(0)
    max_connections_per_address: int = bounded(0)
    handshakes_per_s: float = bounded(0)
    handshake_burst: int = bounded(0)
    max_connections: int = bounded(0)
    signed_in_reserve: float = bounded(0, at_most=0.99)
    max_anonymous_handshakes_per_s: float = bounded(0)
    address_prefix_v4: int = bounded(0, at_most=32)
    address_prefix_v6: int = bounded(0, at_most=128)
    trusted_proxies: list[Any]
    forwarded_header: str
    revalidate_interval_ms: int = bounded(0)
    admission_max_pending: int = bounded(0)
    admission_max_running: int = bounded(1)
    admission_max_per_identity: int = bounded(0)
    admission_bucket_capacity: float
    admission_refill_per_s: float
    admission_error_cost: float = bounded(0)
    admission_close_after_refusals: int = bounded(0)
    max_concurrent_resumes: int = bounded(0)
    max_resumes_per_identity: int = bounded(0)
    idempotency_ttl_s: int
    idempotency_max_answer_bytes: int
    idempotency_max_bytes: int
    idempotency_max_bytes_per_identity: int = bounded(0)
    outbox_databases: list[Any]
    outbox_max_rows: int
    outbox_max_age_s: int
    outbox_dedupe_window_s: int
    presence_interval_ms: int = bounded(50)
    presence_diff_members: int = bounded(0)
    presence_max_members: int = bounded(0)
    presence_info: Any
    presence_info_max_bytes: int = bounded(0)
    presence_list_anonymous: bool
    http_pools: dict[str, Any]
    write_behind_delay_ms: int = bounded(0)
    write_behind_journal_dir: str | None
    probe_top_channels: int = bounded(1)
    probe_top_connections: int = bounded(0)
    probe_ttl_ms: int = bounded(300)
    max_backpressure: int = bounded(0)
    backpressure_policy: str
    close_after_drops: int = bounded(0)
    slow_consumer_bytes: int = bounded(0)
    close_drain_ms: int = bounded(0)
    never_drop_responses: bool
    metrics_token: str | None
    token_ttl_s: int = bounded(1)
    token_max_ttl_s: int = bounded(1)
    token_refresh_before_s: int = bounded(0)
    token_origins: list[str]
    token_salt: str | None
    drain_seconds: int = bounded(0)
    heartbeat_seconds: int = bounded(0)
    freeze_startup_objects: bool
    publish_api_keys: list[str]
    json_encoder: str

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Settings:
        """From the merged dict (:func:`realtime_app.conf.get_config`)."""
        values: dict[str, Any] = {}
        for each in fields(cls):
            value = config[each.name.upper()]
            if each.type == "float" and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            values[each.name] = value
        return cls(**values)
