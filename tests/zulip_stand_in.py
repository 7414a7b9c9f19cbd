"""The stand-in for Zulip's server: the one service the tests cannot run for real.

A small HTTP server on 127.0.0.1 (port 0) that keeps the part of Zulip's REST API
(https://zulip.com/api/) the remediator uses, with the real contract:

- HTTP basic auth with the bot's e-mail and API key on every endpoint but
  `GET /api/v1/server_settings`; 401 `{"result": "error", "code": "UNAUTHORIZED" |
  "INVALID_API_KEY", "msg": …}` otherwise;
- `POST /api/v1/messages`, form-encoded `type` (`stream`/`channel`, `direct`/`private`),
  `to` (a channel by name — or its id, or a JSON list of one name —; for direct messages a
  JSON list of e-mails), `topic` (or the older `subject`) and `content`; a channel that does
  not exist is 400 `STREAM_DOES_NOT_EXIST` with `"stream"` named; an unknown recipient is 400
  `BAD_REQUEST`. Like Zulip, content over `max_message_length` and topics over
  `max_topic_length` are *truncated*, not refused (`\\n[message truncated]`, `...`): a sender
  that does not trim its reports itself loses their end. Such messages are flagged
  `truncated`, so the tests can say it never happened;
- `POST /api/v1/user_uploads`, multipart, answering `uri` and `url` (`/user_uploads/…`);
- `GET /api/v1/messages` with `anchor` (`newest`, `oldest`, an id), `num_before`,
  `num_after`, `narrow` (JSON: `stream`/`channel`, `topic`, `sender`, `dm`/`pm-with`,
  `search` — every word of the operand must be a word of the message) and `apply_markdown`;
- `GET /api/v1/server_settings`: version, feature level and the limits;
- rate limiting per user (`rate_limit(n, window)`): `X-RateLimit-Limit`, `-Remaining` and
  `-Reset` headers on authenticated answers, and past the limit 429 with a `Retry-After`
  header and `"retry-after"` in the JSON `RATE_LIMIT_HIT` error; `force_429(…)` answers the
  next requests so whatever the counts.

It records every request it answers (`requests`, with times and statuses) and every message
and upload it accepted, and can be told to go down — `go_down("refuse")` closes the port,
`go_down("5xx")` answers 502 like a proxy in front of a dead server — and to come back;
`lose_answers(n)` takes the next `n` messages and answers 504 (a proxy that timed out while
Zulip stored the message: the sender cannot know it arrived).
Each request is answered on its own connection (HTTP/1.0), so "down" takes effect at once.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

FEATURE_LEVEL = 256
_WORD = re.compile(r"[\w-]+", re.UNICODE)


@dataclass
class Message:
    """A message the stand-in accepted."""

    id: int
    type: Literal["stream", "private"]
    stream: str | None
    topic: str
    content: str
    recipients: tuple[str, ...]
    sender: str
    timestamp: float
    truncated: bool = False


@dataclass
class Request:
    """A request the stand-in answered."""

    at: float
    method: str
    path: str
    status: int
    form: dict[str, str] = field(default_factory=dict)


def _words(text: str) -> set[str]:
    return {word.lower() for word in _WORD.findall(text)}


class ZulipStandIn:
    """A Zulip server for one bot in one realm (see the module's docstring)."""

    def __init__(
        self,
        *,
        email: str = "gpu-fleet-bot@zulip.example.org",
        streams: tuple[str, ...] = ("agent-hub",),
        users: tuple[str, ...] = ("oncall@example.org", "lead@example.org"),
        max_message_length: int = 10_000,
        max_topic_length: int = 60,
    ) -> None:
        self.email = email
        self.api_key = secrets.token_urlsafe(24)
        self.streams = list(streams)
        self.users = {email, *users}
        self.max_message_length = max_message_length
        self.max_topic_length = max_topic_length
        self.messages: list[Message] = []
        self.uploads: dict[str, bytes] = {}
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._down: Literal["refuse", "5xx"] | None = None
        self._limit: tuple[int, float] | None = None
        self._window_start = 0.0
        self._window_count = 0
        self._forced_429: list[float] = []
        self._lost_answers = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self._listen()

    # -- control ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """`http://127.0.0.1:PORT`: the site of the zuliprc."""
        return f"http://127.0.0.1:{self.port}"

    def write_zuliprc(self, path: Path, *, key: str | None = None) -> Path:
        """A zuliprc for the bot (the key this server checks, unless `key` is given)."""
        path.write_text(f"[api]\nemail={self.email}\nkey={key or self.api_key}\nsite={self.url}\n")
        return path

    def go_down(self, how: Literal["refuse", "5xx"] = "refuse") -> None:
        """Stop answering: close the port (`refuse`) or answer 502 to everything (`5xx`)."""
        with self._lock:
            self._down = how
        if how == "refuse":
            self._close()

    def come_back(self) -> None:
        """Answer again, on the same port."""
        with self._lock:
            was = self._down
            self._down = None
        if was == "refuse":
            self._listen(self.port)

    def rate_limit(self, limit: int, window_seconds: float) -> None:
        """Allow each user `limit` authenticated requests per `window_seconds`."""
        with self._lock:
            self._limit = (limit, window_seconds)
            self._window_start = time.time()
            self._window_count = 0

    def force_429(self, retry_after: float, times: int = 1) -> None:
        """Answer the next `times` authenticated requests 429 with this `Retry-After`."""
        with self._lock:
            self._forced_429 += [retry_after] * times

    def lose_answers(self, times: int = 1) -> None:
        """Store the next `times` messages sent, but answer each 504 (its answer lost)."""
        with self._lock:
            self._lost_answers += times

    def add_message(self, stream: str, topic: str, content: str) -> int:
        """A message from the bot that is already there (sent before a crash, say)."""
        with self._lock:
            return self._store("stream", stream, topic, content, ())

    def stream_messages(self, topic: str | None = None) -> list[Message]:
        """Channel messages in the order received (of `topic` only, if given)."""
        with self._lock:
            return [
                m
                for m in self.messages
                if m.type == "stream" and (topic is None or m.topic == topic)
            ]

    def direct_messages(self) -> list[Message]:
        """Direct messages in the order received."""
        with self._lock:
            return [m for m in self.messages if m.type == "private"]

    def close(self) -> None:
        """Stop serving."""
        self._close()

    def __enter__(self) -> ZulipStandIn:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- serving ------------------------------------------------------------------------------

    def _listen(self, port: int = 0) -> None:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def do_GET(self) -> None:
                stand_in._handle(self, "GET")

            def do_POST(self) -> None:
                stand_in._handle(self, "POST")

            def log_message(self, format: str, *args: Any) -> None:
                del format, args

        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()

    def _close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def _reply(
        self,
        handler: BaseHTTPRequestHandler,
        status: int,
        body: dict[str, Any] | bytes,
        headers: dict[str, str],
    ) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        handler.send_response(status)
        content_type = "text/html" if isinstance(body, bytes) else "application/json"
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(data)

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        parts = urlsplit(handler.path)
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        with self._lock:
            status, body, headers, form = self._answer(handler, method, parts.path,
                                                       parts.query, raw)  # fmt: skip
            self.requests.append(Request(time.time(), method, parts.path, status, form))
        self._reply(handler, status, body, headers)

    # -- the API (called with the lock held) ---------------------------------------------------

    def _answer(
        self,
        handler: BaseHTTPRequestHandler,
        method: str,
        path: str,
        query: str,
        raw: bytes,
    ) -> tuple[int, dict[str, Any] | bytes, dict[str, str], dict[str, str]]:
        if self._down == "5xx":
            return 502, b"<html><body>502 Bad Gateway</body></html>", {}, {}
        if method == "GET" and path == "/api/v1/server_settings":
            return 200, self._server_settings(), {}, {}
        if not self._authenticated(handler.headers.get("Authorization")):
            code, msg = (
                ("UNAUTHORIZED", "Not logged in: API authentication or user session required")
                if not handler.headers.get("Authorization")
                else ("INVALID_API_KEY", "Invalid API key")
            )
            return (
                401,
                {"result": "error", "msg": msg, "code": code},
                {"WWW-Authenticate": 'Basic realm="zulip"'},
                {},
            )
        limited = self._rate_headers()
        if limited is not None:
            return limited
        headers = self._limit_headers()
        form: dict[str, str] = {}
        if method == "POST" and path == "/api/v1/messages":
            form = {k: v[0] for k, v in parse_qs(raw.decode(), keep_blank_values=True).items()}
            status, body = self._send(form)
            if status == 200 and self._lost_answers > 0:
                # Stored, but the answer never reaches the sender: a gateway's timeout page.
                self._lost_answers -= 1
                return 504, b"<html><body>504 Gateway Time-out</body></html>", {}, form
        elif method == "POST" and path == "/api/v1/user_uploads":
            status, body = self._upload(handler.headers.get("Content-Type", ""), raw)
        elif method == "GET" and path == "/api/v1/messages":
            form = {k: v[0] for k, v in parse_qs(query, keep_blank_values=True).items()}
            status, body = self._get_messages(form)
        else:
            status, body = 404, {"result": "error", "msg": "Not Found", "code": "BAD_REQUEST"}
        return status, body, headers, form

    def _server_settings(self) -> dict[str, Any]:
        return {
            "result": "success",
            "msg": "",
            "zulip_version": "9.0-stand-in",
            "zulip_feature_level": FEATURE_LEVEL,
            "push_notifications_enabled": False,
            "authentication_methods": {"password": True},
            "realm_uri": self.url,
            "realm_url": self.url,
            "max_message_length": self.max_message_length,
            "max_topic_length": self.max_topic_length,
        }

    def _authenticated(self, header: str | None) -> bool:
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, key = base64.b64decode(header[6:]).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        return secrets.compare_digest(user, self.email) and secrets.compare_digest(
            key, self.api_key
        )

    def _rate_headers(
        self,
    ) -> tuple[int, dict[str, Any], dict[str, str], dict[str, str]] | None:
        """A 429 answer when this request is over the limit (or forced), else None."""
        now = time.time()
        if self._forced_429:
            retry_after = self._forced_429.pop(0)
        elif self._limit is not None:
            limit, window = self._limit
            if now - self._window_start >= window:
                self._window_start, self._window_count = now, 0
            if self._window_count < limit:
                self._window_count += 1
                return None
            retry_after = self._window_start + window - now
        else:
            return None
        body = {
            "result": "error",
            "msg": "API usage exceeded rate limit",
            "retry-after": retry_after,
            "code": "RATE_LIMIT_HIT",
        }
        headers = {"Retry-After": f"{retry_after:.3f}", **self._limit_headers()}
        return 429, body, headers, {}

    def _limit_headers(self) -> dict[str, str]:
        if self._limit is None:
            return {}
        limit, window = self._limit
        return {
            "X-RateLimit-Limit": str(limit),
            "X-RateLimit-Remaining": str(max(0, limit - self._window_count)),
            "X-RateLimit-Reset": f"{self._window_start + window:.3f}",
        }

    def _store(
        self,
        kind: Literal["stream", "private"],
        stream: str | None,
        topic: str,
        content: str,
        recipients: tuple[str, ...],
    ) -> int:
        truncated = False
        if len(content) > self.max_message_length:
            marker = "\n[message truncated]"
            content = content[: self.max_message_length - len(marker)] + marker
            truncated = True
        if len(topic) > self.max_topic_length:
            topic = topic[: self.max_topic_length - 3] + "..."
            truncated = True
        message = Message(
            id=len(self.messages) + 1,
            type=kind,
            stream=stream,
            topic=topic,
            content=content,
            recipients=recipients,
            sender=self.email,
            timestamp=time.time(),
            truncated=truncated,
        )
        self.messages.append(message)
        return message.id

    @staticmethod
    def _error(msg: str, code: str = "BAD_REQUEST", **extra: Any) -> tuple[int, dict[str, Any]]:
        return 400, {"result": "error", "msg": msg, "code": code, **extra}

    def _send(self, form: dict[str, str]) -> tuple[int, dict[str, Any]]:
        kind = form.get("type")
        content = form.get("content", "")
        if "to" not in form:
            return self._error("Missing 'to' argument", "REQUEST_VARIABLE_MISSING", var_name="to")
        if not content.strip():
            return self._error("Message must not be empty")
        if kind in ("stream", "channel"):
            stream = self._stream_name(form["to"])
            if stream is None:
                return self._error(
                    f"Channel '{form['to']}' does not exist",
                    "STREAM_DOES_NOT_EXIST",
                    stream=form["to"],
                )
            topic = form.get("topic", form.get("subject"))
            if topic is None or not topic.strip():
                return self._error(
                    "Missing 'topic' argument", "REQUEST_VARIABLE_MISSING", var_name="topic"
                )
            message_id = self._store("stream", stream, topic, content, ())
        elif kind in ("direct", "private"):
            try:
                to = json.loads(form["to"])
            except ValueError:
                to = [part.strip() for part in form["to"].split(",")]
            if not isinstance(to, list) or not to:
                return self._error("Invalid recipients")
            unknown = [str(user) for user in to if user not in self.users]
            if unknown:
                return self._error(f"Invalid email '{unknown[0]}'")
            message_id = self._store("private", None, "", content, tuple(sorted(to)))
        else:
            return self._error("Invalid message type")
        return 200, {"result": "success", "msg": "", "id": message_id}

    def _stream_name(self, to: str) -> str | None:
        try:
            parsed = json.loads(to)
        except ValueError:
            parsed = to
        if isinstance(parsed, list) and len(parsed) == 1:
            parsed = parsed[0]
        if isinstance(parsed, int) and 1 <= parsed <= len(self.streams):
            return self.streams[parsed - 1]
        return parsed if isinstance(parsed, str) and parsed in self.streams else None

    def _upload(self, content_type: str, raw: bytes) -> tuple[int, dict[str, Any]]:
        if not content_type.startswith("multipart/form-data"):
            return self._error("You must specify a file to upload")
        parsed = BytesParser(policy=HTTP).parsebytes(
            f"Content-Type: {content_type}\r\n\r\n".encode() + raw
        )
        files = [part for part in parsed.iter_parts() if part.get_filename()]
        if len(files) != 1:
            return self._error("You may only upload one file at a time")
        part = files[0]
        name = Path(str(part.get_filename())).name
        data = part.get_payload(decode=True)
        assert isinstance(data, bytes)
        path = f"/user_uploads/2/{secrets.token_hex(2)}/{secrets.token_urlsafe(12)}/{name}"
        self.uploads[path] = data
        return 200, {"result": "success", "msg": "", "uri": path, "url": path, "filename": name}

    def _get_messages(self, form: dict[str, str]) -> tuple[int, dict[str, Any]]:
        try:
            narrow = json.loads(form.get("narrow", "[]"))
            num_before = int(form.get("num_before", "0"))
            num_after = int(form.get("num_after", "0"))
        except ValueError:
            return self._error("Invalid narrow or counts")
        anchor = form.get("anchor", "newest")
        raw = form.get("apply_markdown", "true") == "false"
        found = [m for m in self.messages if self._matches(m, narrow)]
        if anchor == "newest":
            chosen = found[-(num_before + 1) :] if found else []
        elif anchor == "oldest":
            chosen = found[: num_after + 1]
        else:
            pivot = int(anchor)
            before = [m for m in found if m.id <= pivot][-(num_before + 1) :]
            after = [m for m in found if m.id > pivot][:num_after]
            chosen = before + after
        shown = [self._shown(m, raw) for m in chosen]
        return 200, {
            "result": "success",
            "msg": "",
            "messages": shown,
            "found_newest": anchor == "newest",
            "found_oldest": len(chosen) == len(found),
            "anchor": chosen[-1].id if chosen else 0,
        }

    def _matches(self, message: Message, narrow: list[dict[str, Any]]) -> bool:
        for term in narrow:
            operator, operand = term.get("operator"), term.get("operand")
            if operator in ("stream", "channel") and message.stream != operand:
                return False
            if operator == "topic" and message.topic.lower() != str(operand).lower():
                return False
            if operator == "sender" and message.sender != operand:
                return False
            if operator in ("dm", "pm-with"):
                wanted = operand if isinstance(operand, list) else str(operand).split(",")
                if message.type != "private" or set(message.recipients) != set(wanted):
                    return False
            if operator == "search" and not _words(str(operand)) <= _words(message.content):
                return False
        return True

    def _shown(self, message: Message, raw: bool) -> dict[str, Any]:
        return {
            "id": message.id,
            "type": message.type,
            "display_recipient": message.stream
            if message.type == "stream"
            else [{"email": e} for e in message.recipients],
            "subject": message.topic,
            "content": message.content if raw else f"<p>{message.content}</p>",
            "sender_email": message.sender,
            "timestamp": int(message.timestamp),
        }
