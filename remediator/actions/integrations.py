r"""Actions on the services around the fleet: an allow-listed HTTP call, a Redis clean-up.

    - http_request:                        # e.g. tell a router to reload its roster
        url: http://127.0.0.1:4000/reload  # listed in the config's http_request.allowed_urls
        method: POST                       # GET POST PUT DELETE
        body: {"reason": "gpu-fleet"}      # optional JSON
        expect_status: [200, 204]
    - redis_delete:                        # e.g. a router's stale circuit breaker for a server
        keys: ["router:breaker:{server}"]  # exact keys (placeholders from the roster) …
        match: "router:active:{server}:*"  # … and/or a SCAN pattern
        max_keys: 1000

Both refuse before doing anything when the config does not allow it: `http_request` calls only
URLs listed (exact match, a trailing `/` aside) in `http_request.allowed_urls`; `redis_delete`
deletes only keys that match one of `redis.allowed_key_patterns` (globs: `*`, `?`, `[abc]`,
matched with `fnmatch.fnmatchcase`, case-sensitive like Redis). An exact key outside the
patterns fails the step with nothing deleted; keys a SCAN finds outside them are left alone
and named in the output.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Literal

import redis
from pydantic import Field, field_validator

from remediator.actions.registry import ActionContext, ActionParams, StepResult, action
from remediator.actions.serving import http_call, read_key

_MAX_SHOWN_KEYS = 50


class HttpRequestParams(ActionParams):
    """`http_request`: one request to an allow-listed URL."""

    url: str = Field(min_length=1, max_length=2000)
    method: Literal["GET", "POST", "PUT", "DELETE"] = "POST"
    body: dict[str, Any] | None = None
    expect_status: list[int] = Field(default=[200, 201, 202, 204], min_length=1)
    timeout_seconds: float = Field(default=10.0, gt=0, le=300)

    @field_validator("expect_status")
    @classmethod
    def _statuses(cls, value: list[int]) -> list[int]:
        if any(not 100 <= status <= 599 for status in value):
            raise ValueError("HTTP statuses are 100 to 599")
        return value

    def needs_seconds(self) -> float:
        """The request's own time limit."""
        return self.timeout_seconds


@action("http_request", HttpRequestParams, default_timeout_seconds=15.0)
def http_request(ctx: ActionContext, params: HttpRequestParams) -> StepResult:
    """Send one request, only to a URL the config allows.

    One request, only to a URL listed in `http_request.allowed_urls` (e.g. a router's roster
    reload).
    """
    allowed = {url.rstrip("/") for url in ctx.settings.http_allowed_urls}
    if params.url.rstrip("/") not in allowed:
        return StepResult(
            False,
            f"refused: {params.url} is not in the config's http_request.allowed_urls",
            {"refused": True},
        )
    answer = http_call(
        params.method,
        params.url,
        timeout=min(params.timeout_seconds, ctx.remaining()),
        body=params.body,
    )
    what = f"{params.method} {params.url}"
    if answer.error is not None:
        return StepResult(False, answer.error)
    details = {"status": answer.status, "body_excerpt": answer.excerpt()}
    if answer.status not in params.expect_status:
        return StepResult(
            False,
            f"{what} answered {answer.status}, expected {params.expect_status}: {answer.excerpt()}",
            details,
        )
    return StepResult(True, f"{what} answered {answer.status}", details)


class RedisDeleteParams(ActionParams):
    """`redis_delete`: exact keys and/or a SCAN pattern; at most `max_keys` deleted."""

    keys: list[str] = Field(default=[], max_length=100)
    match: str | None = Field(default=None, min_length=1, max_length=512)
    max_keys: int = Field(default=1000, ge=1, le=100_000)
    timeout_seconds: float = Field(default=10.0, gt=0, le=300)

    @field_validator("keys")
    @classmethod
    def _keys(cls, value: list[str]) -> list[str]:
        if any(not key for key in value):
            raise ValueError("a key is not empty")
        return value

    def needs_seconds(self) -> float:
        """The connection's time limit."""
        return self.timeout_seconds


def allowed_key(key: str, patterns: tuple[str, ...]) -> bool:
    """Whether `key` matches one of the allowed glob patterns (case-sensitive)."""
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)


@action("redis_delete", RedisDeleteParams, default_timeout_seconds=15.0)
def redis_delete(ctx: ActionContext, params: RedisDeleteParams) -> StepResult:
    """Delete the given keys and those a SCAN finds, only where the config's patterns allow.

    Deletes keys (exact, and/or found by SCAN) only where they match
    `redis.allowed_key_patterns` (globs); an exact key outside them refuses the whole step.
    """
    options = ctx.settings.redis
    if options is None:
        return StepResult(False, "refused: no redis section in the config")
    if not params.keys and params.match is None:
        return StepResult(False, "error: give keys, match, or both")
    patterns = options.allowed_key_patterns
    refused = [key for key in params.keys if not allowed_key(key, patterns)]
    if refused:
        return StepResult(
            False,
            f"refused: {', '.join(repr(k) for k in refused[:5])} not allowed by "
            f"redis.allowed_key_patterns {list(patterns)}; nothing deleted",
            {"refused": refused},
        )
    try:
        password = read_key(options.password_file) if options.password_file else None
    except (OSError, ValueError) as exc:
        return StepResult(False, f"redis password unusable: {exc}")
    timeout = max(0.1, min(params.timeout_seconds, ctx.remaining()))
    client = redis.Redis.from_url(
        options.url, password=password, socket_timeout=timeout, socket_connect_timeout=timeout
    )
    skipped: list[str] = []
    try:
        chosen = list(dict.fromkeys(params.keys))
        if params.match is not None:
            for raw in client.scan_iter(match=params.match, count=500):
                key = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
                if not allowed_key(key, patterns):
                    skipped.append(key)
                elif key not in chosen:
                    chosen.append(key)
                if len(chosen) >= params.max_keys or ctx.cancel.is_set():
                    break
        deleted = int(client.delete(*chosen)) if chosen else 0
    except redis.RedisError as exc:
        return StepResult(False, f"redis at {options.url}: {exc}")
    finally:
        client.close()
    shown = ", ".join(chosen[:_MAX_SHOWN_KEYS]) + (" …" if len(chosen) > _MAX_SHOWN_KEYS else "")
    output = f"deleted {deleted} of {len(chosen)} key(s): {shown or 'none'}"
    if skipped:
        output += f"; left alone (not allowed): {', '.join(skipped[:_MAX_SHOWN_KEYS])}"
    return StepResult(True, output, {"deleted": deleted, "keys": chosen, "skipped": skipped})
