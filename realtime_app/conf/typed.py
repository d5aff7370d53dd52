"""The settings as one typed, frozen object: ``REALTIME_APP`` merged over the defaults
(:data:`realtime_app.conf.DEFAULTS`, where each is explained), one attribute per key.

Read it as :func:`realtime_app.conf.runtime.settings` (the process's runtime builds it once
and states the reload rule). Values are the user's, checked by the system checks
(``manage.py check``), not here: a wrong type is reported there, never coerced silently
beyond an int given for a float.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["Settings"]


@dataclass(frozen=True, slots=True)
class Settings:
    """Every ``REALTIME_APP`` key, lower-cased (``ADMISSION_MAX_PENDING`` →
    ``admission_max_pending``)."""

    policies: list[Any]
    builtin_policies: list[Any]
    autodiscover_module: str
    max_frame_bytes: int
    max_batch: int
    max_channel_name: int
    max_subscriptions: int
    backplane: str
    redis_url: str | None
    redis_shards: list[Any] | None
    redis_cluster: list[str] | None
    key_prefix: str
    lease_ttl_ms: int
    reassert_interval_ms: int
    seq_idle_ttl_ms: int
    redis_max_connections: int
    redis_timeout_ms: int
    publish_concurrency: int
    max_publication_bytes: int
    max_cadences_per_family: int
    max_tickers: int
    max_instances: int
    max_instances_per_template: int
    max_tickers_per_identity: int
    max_instances_per_identity: int
    max_backplane_bytes_per_identity: int
    max_connections_per_user: int
    max_connections_per_address: int
    handshakes_per_s: float
    handshake_burst: int
    max_connections: int
    signed_in_reserve: float
    max_anonymous_handshakes_per_s: float
    address_prefix_v4: int
    address_prefix_v6: int
    trusted_proxies: list[Any]
    forwarded_header: str
    revalidate_interval_ms: int
    admission_max_pending: int
    admission_max_running: int
    admission_max_per_identity: int
    admission_bucket_capacity: float
    admission_refill_per_s: float
    admission_error_cost: float
    admission_close_after_refusals: int
    max_concurrent_resumes: int
    max_resumes_per_identity: int
    idempotency_ttl_s: int
    idempotency_max_answer_bytes: int
    idempotency_max_bytes: int
    idempotency_max_bytes_per_identity: int
    outbox_databases: list[Any]
    outbox_max_rows: int
    outbox_max_age_s: int
    outbox_dedupe_window_s: int
    presence_interval_ms: int
    presence_diff_members: int
    presence_max_members: int
    presence_info: Any
    presence_info_max_bytes: int
    presence_list_anonymous: bool
    http_pools: dict[str, Any]
    write_behind_delay_ms: int
    write_behind_journal_dir: str | None
    probe_top_channels: int
    probe_top_connections: int
    probe_ttl_ms: int
    max_backpressure: int
    backpressure_policy: str
    close_after_drops: int
    slow_consumer_bytes: int
    close_drain_ms: int
    never_drop_responses: bool
    metrics_token: str | None
    token_ttl_s: int
    token_max_ttl_s: int
    token_refresh_before_s: int
    token_origins: list[str]
    token_salt: str | None
    drain_seconds: int
    heartbeat_seconds: int
    publish_api_keys: list[str]
    json_encoder: str

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Settings:
        """From the merged dict (:func:`realtime_app.conf.get_config`)."""
        values: dict[str, Any] = {}
        for field in fields(cls):
            value = config[field.name.upper()]
            if field.type == "float" and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            values[field.name] = value
        return cls(**values)
