"""Alertmanager's webhook payload (version 4), validated field by field.

Alertmanager POSTs one notification per alert group: `version` "4", the group's key and
labels, and `alerts`, each with `status`, `labels`, `annotations`, `startsAt`, `endsAt`,
`generatorURL` and `fingerprint` (Alertmanager's docs, "webhook_config"). An alert is one
occurrence of a problem: Alertmanager resends it on every group interval and repeat interval,
and both members of an HA pair send it, so (`fingerprint`, `startsAt`) is its identity.

A payload that is not such a notification is refused with a message naming the bad field
(`alerts[2].startsAt: Input should be a valid datetime`), so Alertmanager's logs say what is
wrong; nothing of it is acted on.

Times are aware UTC once parsed (a time without an offset is taken as UTC, as Alertmanager
writes them). Alertmanager's zero time, `0001-01-01T00:00:00Z` — the `endsAt` of every firing
alert — means "none". A time that cannot be represented in UTC (`0001-01-01T00:00:00+01:00`
lies before the year 1) is refused with its field named.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ZERO_TIME = datetime(1, 1, 1, tzinfo=UTC)
"""Go's zero `time.Time`, which Alertmanager sends for "no time" (`endsAt` while firing)."""


def as_utc(value: datetime) -> datetime:
    """`value` in aware UTC; raises ValueError when UTC cannot represent it."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("cannot be represented in UTC (out of the years 1 to 9999)") from None


def minus(when: datetime, delta: timedelta) -> datetime:
    """`when - delta`, held at the earliest representable time instead of overflowing.

    Alerts may carry any valid time, the year 1 included (`0001-01-01T00:00:01Z`): every
    window reaching back from one (dedupe, a report's chart) must not fail on it.
    """
    try:
        return when - delta
    except OverflowError:
        return datetime.min.replace(tzinfo=when.tzinfo)


class PayloadError(ValueError):
    """A webhook body that is not a version-4 notification; the message names the field."""


class _Model(BaseModel):
    # Alertmanager adds fields over time; unknown ones are kept out of our way, not refused.
    model_config = ConfigDict(extra="ignore", frozen=True)


class Alert(_Model):
    """One alert of a notification."""

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = {}
    startsAt: datetime
    endsAt: datetime | None = None
    generatorURL: str = ""
    fingerprint: str = Field(min_length=1, max_length=64)

    @field_validator("startsAt", mode="after")
    @classmethod
    def _starts_utc(cls, value: datetime) -> datetime:
        utc = as_utc(value)
        if utc == ZERO_TIME:
            raise ValueError("the zero time: an alert must say when it started")
        return utc

    @field_validator("endsAt", mode="after")
    @classmethod
    def _ends_utc(cls, value: datetime | None) -> datetime | None:
        if value is None:
            return None
        utc = as_utc(value)
        return None if utc == ZERO_TIME else utc

    @property
    def alertname(self) -> str:
        """The `alertname` label ("" if absent)."""
        return self.labels.get("alertname", "")


class Notification(_Model):
    """One webhook notification (one alert group)."""

    version: Literal["4"]
    groupKey: str
    truncatedAlerts: int = Field(default=0, ge=0)
    status: Literal["firing", "resolved"]
    receiver: str
    groupLabels: dict[str, str] = {}
    commonLabels: dict[str, str] = {}
    commonAnnotations: dict[str, str] = {}
    externalURL: str = ""
    alerts: list[Alert] = Field(min_length=1)


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(body)"


def parse_notification(body: bytes) -> Notification:
    """Validate a webhook body; raises `PayloadError` naming the first bad fields."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PayloadError(f"body is not JSON: {exc}") from None
    except RecursionError:
        raise PayloadError("(body): JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise PayloadError("(body): must be a JSON object (an Alertmanager notification)")
    try:
        return Notification.model_validate(data)
    except RecursionError:
        raise PayloadError("(body): nested too deeply") from None
    except ValidationError as exc:
        problems = [f"{_path(tuple(err['loc']))}: {err['msg']}" for err in exc.errors()[:10]]
        raise PayloadError("; ".join(problems)) from None
