"""A thin adapter over the `zulip` package's `Client`: send, upload, look up, and say why not.

The client is made from the `zuliprc` named in the config — the bot's e-mail, key and site
live there and nowhere else — and is made lazily, because its constructor already asks the
server for `/api/v1/server_settings` and fails when the server is down. It is made with

- `insecure=False`: TLS verification stays on whatever the zuliprc or `ZULIP_ALLOW_INSECURE`
  say (a `cert_bundle` in the zuliprc, a private CA, is honoured: verification against it);
- `retry_on_errors=False`: the client would otherwise sleep and retry 5xx and dropped
  connections itself, ten times, inside the sender's loop; the outbox retries instead, with
  backoff, without holding up the other topics' reports.

Zulip answers errors as `{"result": "error", "msg": …, "code": …}` (https://zulip.com/api/
rest-error-handling); the client returns that JSON and hides the HTTP status and headers, so
a `requests` response hook records them: the status tells a 429 and a 5xx apart, and the
`Retry-After` and `X-RateLimit-Remaining`/`X-RateLimit-Reset` headers tell the sender how
long to wait. Errors become three exceptions:

- `ZulipUnavailable`: no answer, a timeout, a 5xx — it may or may not have been delivered;
- `ZulipRateLimited`: 429 `RATE_LIMIT_HIT`, with the seconds to wait;
- `ZulipRefused`: Zulip said no; `permanent` unless it is something an operator fixes
  without changing the report (a wrong key: `UNAUTHORIZED`/`INVALID_API_KEY` — the zuliprc
  is read again on the next try —, a stream not yet created: `STREAM_DOES_NOT_EXIST`).
"""

from __future__ import annotations

import configparser
import io
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import zulip

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_LENGTH = 10_000
DEFAULT_MAX_TOPIC_LENGTH = 60
# Feature levels (https://zulip.com/api/changelog): "direct" as a message type (174) and the
# "dm" narrow operator (177); older servers know them as "private" and "pm-with".
_DIRECT_TYPE_LEVEL = 174
_DM_NARROW_LEVEL = 177
# Codes of refusals an operator fixes on the Zulip side; the report itself is fine.
_AUTH_CODES = frozenset({"UNAUTHORIZED", "INVALID_API_KEY", "USER_DEACTIVATED"})
_RETRYABLE_CODES = _AUTH_CODES | {"STREAM_DOES_NOT_EXIST"}
_LIMITS_REFRESH_SECONDS = 3600.0
_LOOKUP_RECENT = 100
_LOOKUP_SEARCHED = 20


class ZulipUnavailable(Exception):
    """No usable answer (unreachable, timeout, 5xx): the request may have been processed."""


class ZulipRateLimited(Exception):
    """429 RATE_LIMIT_HIT: wait `retry_after` seconds before the next request."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ZulipRefused(Exception):
    """Zulip refused the request (`code`); `permanent` when sending it again cannot help."""

    def __init__(self, message: str, code: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.code = code
        self.permanent = permanent


@dataclass(frozen=True)
class ServerLimits:
    """What the server accepts (from `/api/v1/server_settings`, Zulip's defaults otherwise)."""

    max_message_length: int = DEFAULT_MAX_MESSAGE_LENGTH
    max_topic_length: int = DEFAULT_MAX_TOPIC_LENGTH
    feature_level: int = 0


class _NamedBytes(io.BytesIO):
    """An in-memory file with a name: the client names the multipart part after it."""

    def __init__(self, data: bytes, name: str) -> None:
        super().__init__(data)
        self.name = name


def _read_zuliprc(path: Path) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        with path.open(encoding="utf-8") as handle:
            parser.read_file(handle, str(path))
    except (OSError, UnicodeDecodeError, configparser.Error) as exc:
        # Never the parser's text: it may quote the line that holds the key.
        raise ZulipRefused(
            f"{path}: cannot read the zuliprc ({type(exc).__name__})", "ZULIPRC", permanent=False
        ) from None
    section = dict(parser["api"]) if parser.has_section("api") else {}
    missing = [key for key in ("email", "key", "site") if not section.get(key)]
    if missing:
        raise ZulipRefused(f"{path}: [api] lacks {', '.join(missing)}", "ZULIPRC", permanent=False)
    return section


class ZulipApi:
    """One bot's view of one Zulip server, through the real `zulip.Client`."""

    def __init__(self, zuliprc: Path, *, timeout_seconds: float = 15.0) -> None:
        self.zuliprc = zuliprc
        self.timeout_seconds = timeout_seconds
        self._client: zulip.Client | None = None
        self._limits: ServerLimits | None = None
        self._limits_at = 0.0
        self._lock = threading.Lock()
        self._status = 0
        self._headers: dict[str, str] = {}
        self.rate_limit_reset: float | None = None
        """Unix time until which the server said no request is left (`X-RateLimit-*`)."""

    # -- the client -----------------------------------------------------------------------

    def _on_response(self, response: requests.Response, *args: Any, **kwargs: Any) -> None:
        del args, kwargs
        self._status = response.status_code
        self._headers = {k.lower(): v for k, v in response.headers.items()}
        remaining = self._headers.get("x-ratelimit-remaining")
        reset = self._headers.get("x-ratelimit-reset")
        try:
            if remaining is not None and reset is not None and float(remaining) <= 0:
                self.rate_limit_reset = float(reset)
            elif remaining is not None:
                self.rate_limit_reset = None
        except ValueError:
            pass  # a header we cannot read is not a reason to stop sending

    def client(self) -> zulip.Client:
        """The client, made on first use (its constructor talks to the server)."""
        with self._lock:
            if self._client is not None:
                return self._client
            rc = _read_zuliprc(self.zuliprc)
            try:
                client = zulip.Client(
                    email=rc["email"],
                    api_key=rc["key"],
                    site=rc["site"],
                    config_file=str(self.zuliprc),
                    cert_bundle=rc.get("cert_bundle"),
                    insecure=False,
                    retry_on_errors=False,
                    client="gpu-fleet-remediator",
                )
            except (zulip.ZulipError, requests.RequestException) as exc:
                raise ZulipUnavailable(f"cannot reach Zulip at {rc['site']}: {exc}") from None
            except (AssertionError, KeyError, TypeError, ValueError) as exc:
                # The constructor asks /api/v1/server_settings and asserts on its answer: a 5xx
                # or a proxy's error page there surfaces as an AssertionError (zulip's
                # `assert self.zulip_version is not None`), not as an HTTP error.
                raise ZulipUnavailable(
                    f"Zulip at {rc['site']} gave no usable server settings on first contact "
                    f"({type(exc).__name__}): down or answering 5xx"
                ) from None
            client.ensure_session()
            assert client.session is not None
            client.session.hooks["response"].append(self._on_response)
            # No proxy from the environment: the bot's key goes to the zuliprc's site only.
            client.session.trust_env = False
            self._client = client
            return client

    def _call(
        self,
        url: str,
        *,
        method: str = "POST",
        request: dict[str, Any] | None = None,
        files: list[Any] | None = None,
    ) -> dict[str, Any]:
        client = self.client()
        self._status = 0
        try:
            result = client.call_endpoint(
                url=url, method=method, request=request, files=files, timeout=self.timeout_seconds
            )
        except (zulip.ZulipError, requests.RequestException) as exc:
            raise ZulipUnavailable(f"{method} /api/v1/{url}: {type(exc).__name__}: {exc}") from None
        if result.get("result") == "success":
            return result
        status = self._status
        code = str(result.get("code", ""))
        message = str(result.get("msg", "no message"))
        if status == 429 or code == "RATE_LIMIT_HIT":
            raise ZulipRateLimited(f"rate limited: {message}", self._retry_after(result))
        if status >= 500 or result.get("result") == "http-error":
            raise ZulipUnavailable(f"{method} /api/v1/{url}: HTTP {status}: {message}")
        if code in _AUTH_CODES or status == 401:
            # Made again on the next call: a key fixed in the zuliprc is read without a restart.
            with self._lock:
                self._client = None
        raise ZulipRefused(
            f"{method} /api/v1/{url}: HTTP {status} {code}: {message}",
            code or f"HTTP_{status}",
            permanent=code not in _RETRYABLE_CODES,
        )

    def _retry_after(self, result: dict[str, Any]) -> float:
        for value in (self._headers.get("retry-after"), result.get("retry-after")):
            try:
                if value is not None:
                    return max(0.0, float(value))
            except (TypeError, ValueError):
                continue
        reset = self.rate_limit_reset
        return max(1.0, reset - time.time()) if reset is not None else 1.0

    # -- the calls ------------------------------------------------------------------------

    def limits(self) -> ServerLimits:
        """The server's message and topic limits (asked again every hour)."""
        now = time.monotonic()
        if self._limits is not None and now - self._limits_at < _LIMITS_REFRESH_SECONDS:
            return self._limits
        settings = self._call("server_settings", method="GET")

        def number(key: str, default: int) -> int:
            value = settings.get(key)
            return value if isinstance(value, int) and value > 0 else default

        self._limits = ServerLimits(
            max_message_length=number("max_message_length", DEFAULT_MAX_MESSAGE_LENGTH),
            max_topic_length=number("max_topic_length", DEFAULT_MAX_TOPIC_LENGTH),
            feature_level=number("zulip_feature_level", 0),
        )
        self._limits_at = now
        return self._limits

    def send_stream(self, stream: str, topic: str, content: str) -> int:
        """Post `content` in `stream` > `topic`; the new message's id."""
        request = {"type": "stream", "to": stream, "topic": topic, "content": content}
        return int(self._call("messages", request=request)["id"])

    def send_direct(self, recipients: Sequence[str], content: str) -> int:
        """Send `content` as a direct message to `recipients` (e-mail addresses); its id."""
        kind = "direct" if self.limits().feature_level >= _DIRECT_TYPE_LEVEL else "private"
        request = {"type": kind, "to": list(recipients), "content": content}
        return int(self._call("messages", request=request)["id"])

    def upload(self, name: str, data: bytes) -> str:
        """Upload a file; its `/user_uploads/…` path, to link in a message."""
        result = self._call("user_uploads", files=[_NamedBytes(data, name)])
        # "url" since feature level 272, "uri" before (and still sent alongside).
        path = result.get("url") or result.get("uri")
        if not isinstance(path, str) or not path:
            raise ZulipUnavailable("the upload was answered without its URL")
        return path

    def find(
        self,
        marker: str,
        search: str,
        *,
        stream: str | None = None,
        topic: str | None = None,
        recipients: Sequence[str] | None = None,
    ) -> int | None:
        """The id of this bot's message holding `marker` in a stream's topic or a DM; None.

        First the newest messages of the narrow (the search index lags behind new messages),
        then Zulip's full-text search for `search` in it. Raw Markdown is asked for
        (`apply_markdown=false`), so the marker is compared as it was sent.
        """
        client = self.client()
        narrow: list[dict[str, Any]]
        if recipients is not None:
            operator = "dm" if self.limits().feature_level >= _DM_NARROW_LEVEL else "pm-with"
            narrow = [{"operator": operator, "operand": ",".join(recipients)}]
        else:
            narrow = [
                {"operator": "stream", "operand": stream},
                {"operator": "topic", "operand": topic},
            ]
        narrow.append({"operator": "sender", "operand": client.email})
        searched = [{"operator": "search", "operand": search}]
        passes: list[tuple[list[dict[str, Any]], int]] = [
            ([], _LOOKUP_RECENT),
            (searched, _LOOKUP_SEARCHED),
        ]
        for extra, count in passes:
            request = {
                "anchor": "newest",
                "num_before": count,
                "num_after": 0,
                "narrow": narrow + extra,
                "apply_markdown": False,
            }
            found = self._call("messages", method="GET", request=request)
            for message in found.get("messages", []):
                if isinstance(message, dict) and marker in str(message.get("content", "")):
                    return int(message["id"])
        return None
