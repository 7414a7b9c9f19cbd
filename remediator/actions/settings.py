"""What actions need from the remediator's config, as one immutable object.

`ActionSettings` rides on every `ActionContext` (`ctx.settings`); `action_settings(config)`
builds it from a validated `RemediatorConfig`. The default (no config) has no executor, no
allowed URL and no Redis: host actions then fail with a clear reason instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from remediator.actions.executors import ExecutorSettings, SshOptions

if TYPE_CHECKING:
    from remediator.config import RemediatorConfig


@dataclass(frozen=True)
class RedisOptions:
    """Where `redis_delete` works, and the glob patterns of the only keys it may delete."""

    url: str
    allowed_key_patterns: tuple[str, ...]
    password_file: Path | None = None


@dataclass(frozen=True)
class ActionSettings:
    """Executors, the `http_request` allow-list, Redis, and the power-cap restore interval."""

    executors: ExecutorSettings | None = None
    http_allowed_urls: frozenset[str] = frozenset()
    redis: RedisOptions | None = None
    power_cap_check_interval_seconds: float = 60.0


def action_settings(config: RemediatorConfig) -> ActionSettings:
    """The actions' settings from a validated config."""
    ssh = config.ssh
    redis = config.redis
    return ActionSettings(
        executors=ExecutorSettings(
            roster_path=config.roster,
            ssh=SshOptions(
                binary=ssh.binary,
                identity_file=ssh.identity_file,
                known_hosts_file=ssh.known_hosts_file,
                connect_timeout_seconds=ssh.connect_timeout_seconds,
            ),
            node_command=tuple(config.node_command),
        ),
        http_allowed_urls=frozenset(config.http_request.allowed_urls),
        redis=(
            RedisOptions(
                url=redis.url,
                allowed_key_patterns=tuple(redis.allowed_key_patterns),
                password_file=redis.password_file,
            )
            if redis is not None
            else None
        ),
        power_cap_check_interval_seconds=config.power_cap.check_interval_seconds,
    )
