"""A small, bounded HTTP client for reading model servers (llama-server, vLLM).

Every call has a timeout and returns an `Answer` instead of raising: the collectors need to tell
"refused" (the process is gone) from "timed out" (it is alive but busy, or hung) from "answered
with an error status", because those mean different things for llama-server (DESIGN.md, the
llama-server facts). TLS verification stays on for `https://` URLs.
"""

from __future__ import annotations

import http.client
import ssl
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from urllib.parse import urlsplit

USER_AGENT = "gpu-fleet-exporter"
MAX_BODY_BYTES = 8 * 1024 * 1024  # /slots of a many-slot server is the largest answer we read


class Outcome(Enum):
    """How a call ended."""

    ANSWERED = "answered"  # an HTTP status came back (any status)
    TIMEOUT = "timeout"  # connected (or connecting) but no answer within the timeout
    REFUSED = "refused"  # nothing listens: connection refused or reset before an answer
    ERROR = "error"  # anything else: DNS, TLS, a malformed or oversized answer


@dataclass(frozen=True)
class Answer:
    """The result of one call: `status` and `body` are set only when `outcome` is ANSWERED."""

    outcome: Outcome
    status: int = 0
    body: bytes = b""
    detail: str = ""

    @property
    def ok(self) -> bool:
        """True for a 200 answer."""
        return self.outcome is Outcome.ANSWERED and self.status == 200


def read_secret(path: Path | None) -> str | None:
    """A secret from a file (its whole content, stripped of surrounding whitespace).

    None without a path.

    Raises `OSError` when the file cannot be read, so the caller can say which file.
    """
    if path is None:
        return None
    return path.read_text(encoding="utf-8").strip()


def call(
    url: str,
    *,
    timeout: float,
    method: str = "GET",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Answer:
    """One HTTP request; never raises for network trouble, only returns an `Answer`.

    `timeout` bounds the connection and each read of the socket, not the whole call: a server
    that trickles bytes can take longer, so callers that must be bounded wait on a deadline
    of their own (the collectors do).
    """
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    conn: http.client.HTTPConnection
    try:
        host, port = parts.hostname or "", parts.port
    except ValueError as exc:  # a port that is not a number: the roster normally stops it
        return Answer(Outcome.ERROR, detail=f"bad URL {url!r}: {exc}")
    if parts.scheme == "https":
        context = ssl_context or ssl.create_default_context()
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    send_headers = {"User-Agent": USER_AGENT, "Accept": "*/*", **(headers or {})}
    try:
        conn.request(method, path, body=body, headers=send_headers)
        response = conn.getresponse()
        data = response.read(MAX_BODY_BYTES + 1)
        if len(data) > MAX_BODY_BYTES:
            return Answer(Outcome.ERROR, detail=f"answer larger than {MAX_BODY_BYTES} bytes")
        return Answer(Outcome.ANSWERED, response.status, data)
    except TimeoutError:
        return Answer(Outcome.TIMEOUT, detail=f"no answer within {timeout:g} s")
    except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError) as exc:
        return Answer(Outcome.REFUSED, detail=f"{type(exc).__name__}: {exc}")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        # ssl.SSLError is an OSError; RemoteDisconnected is an HTTPException.
        return Answer(Outcome.ERROR, detail=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
