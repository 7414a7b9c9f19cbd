"""The remediator's config file: typed, validated completely at start-up, secrets from files.

Every key is documented for operators in docs/remediator-config.md (keys are added, never
renamed); in short:

    listen: 127.0.0.1:9095                    # host:port or [v6]:port (default shown)
    roster: /etc/gpu-fleet/fleet.yaml         # the roster (default shown); must be readable
    journal: sqlite:////var/lib/gpu-fleet/journal.db   # SQLAlchemy URL; or postgresql://…
    auth: {bearer_token_file: /etc/gpu-fleet/webhook.token}   # Alertmanager's credentials;
                                              # or basic_auth: {username, password_file}
    admin: {bearer_token_file: /etc/gpu-fleet/admin.token}    # for /api/*: a different secret
    prometheus_url: http://127.0.0.1:9090     # default shown
    playbooks_dir: /etc/gpu-fleet/playbooks   # optional; the built-in playbooks always load
    dry_run: false
    zulip:                                    # optional
      zuliprc: /etc/gpu-fleet/zuliprc         # the Zulip key lives here and nowhere else
      stream: agent-hub
      topics: {gpu: alerts-gpu, inference: alerts-gpu, infra: alerts-infra}  # category → topic
      default_topic: gpu-fleet                # alerts whose category has no topic (default)
      escalate_to: [oncall@example.org]       # optional: escalations also as direct messages
      grafana_url: https://grafana.example.org/d/gpu-fleet   # optional: a dashboard to link
      alertmanager_url: https://alertmanager.example.org     # optional: silence links
    reports_dir: /var/lib/gpu-fleet/reports   # without `zulip`: reports as Markdown files
    replica_id: central-1                     # default: this machine's hostname
    workers: 4                                # threads that run playbooks
    retention_days: 30                        # how long the journal keeps finished runs
    limits: {max_concurrent_runs: 4, max_runs_per_hour: 30,   # fleet-wide caps
             max_wait_seconds: 3600,          # a run waiting for a passing reason, at most
             wait_report_after_seconds: 300}  # a short report once it waited this long
    lock_ttl_seconds: 900                     # a silent replica's running runs free their targets
    web_config_file: /etc/gpu-fleet/remediator-web.yml   # optional: TLS for the listener
    ui:                                       # optional: the read-only page at /ui/
      username: ui                            # basic auth (default shown)
      password_file: /etc/gpu-fleet/ui.password   # the password, or its bcrypt hash ($2b$…)
    dedupe_window_seconds: 600                # copies of an alert whose startsAt differ by less
                                              # are one occurrence (HA Prometheus pairs)

What host actions need (all optional; the defaults shown):

    ssh:                                      # the OpenSSH client that reaches gpu-fleet-node
      binary: ssh                             # a program on PATH or an absolute path
      identity_file: /etc/gpu-fleet/ssh/id_ed25519   # optional: only this key (IdentitiesOnly)
      known_hosts_file: /etc/gpu-fleet/ssh/known_hosts  # optional: strict checking is always on
      connect_timeout_seconds: 10
    node_command: [gpu-fleet-node]            # for roster hosts with `local: true`
    http_request:
      allowed_urls: [http://127.0.0.1:4000/reload]   # the only URLs `http_request` may call
    redis:                                    # optional: for `redis_delete`
      url: redis://127.0.0.1:6379/0           # no password in the URL: password_file
      password_file: /etc/gpu-fleet/redis.password   # optional
      allowed_key_patterns: ["router:breaker:*"]     # glob (* ? [abc]); only such keys go
    power_cap:
      check_interval_seconds: 60              # how often due power-cap restores are checked

Relative paths are taken from the config file's directory. Unknown keys are refused (a typo
must stop the start, not be ignored), and every problem is reported at once, one line each:
`remediator.yaml: auth.bearer_token_file: no such file`.

Secrets never sit in the YAML: a key like `token:` or `password:` is refused ("secrets come
from files"), and so is a password inside the journal URL (libpq reads it from a passfile:
`postgresql://remediator@db/journal?passfile=/etc/gpu-fleet/pgpass`). Secret files are checked
at load (exist, readable, not empty); their content is read by `read_secret` and never logged.
The admin secret must differ from the webhook's (not the same file, not the same content):
Alertmanager's credentials, which sit in its own config, must not open the admin API. The
page's password must differ from both (a browser remembers it; neither may be what it holds).
"""

from __future__ import annotations

import base64
import binascii
import configparser
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from fleet.roster import DEFAULT_ROSTER_PATH
from fleet.yamlfile import load_strict

_log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:9095"
DEFAULT_JOURNAL = "sqlite:////var/lib/gpu-fleet/journal.db"
DEFAULT_PROMETHEUS_URL = "http://127.0.0.1:9090"
REALM = "gpu-fleet-remediator"

# Keys that would put a secret inline; each is answered with the file key to use instead.
_INLINE_SECRET_KEYS = {
    "token": "bearer_token_file",
    "bearer_token": "bearer_token_file",
    "password": "password_file",
    "secret": "a *_file key",
    "api_key": "a *_file key",
    "key": "a *_file key",
    "credentials": "a *_file key",
}
# Zulip's limits (zulip/zerver/models: MAX_TOPIC_NAME_LENGTH, MAX_NAME_LENGTH of a stream).
_ZULIP_NAME_MAX = 60
# RFC 6750's b64token: what a bearer token in an `Authorization` header can consist of.
_BEARER_TOKEN = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
_REPLICA_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_.-]{1,63}$")
# RFC 1123 host names, as in the roster.
_DNS_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_DNS_LABEL}(\.{_DNS_LABEL})*$")


class ConfigError(Exception):
    """The config cannot be used; one line per problem: `FILE: key.path: message`."""


# --- key paths ------------------------------------------------------------------------------


def key_path(loc: tuple[int | str, ...]) -> str:
    """`("playbooks", 2, "steps")` → `playbooks[2].steps`; `(top level)` for `()`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def validation_problems(
    exc: ValidationError, prefix: tuple[int | str, ...] = ()
) -> list[tuple[str, str]]:
    """`(key path, message)` for every error of a pydantic `ValidationError`.

    `prefix` is prepended to each location (a nested model validated on its own). Unknown keys
    that would hold a secret inline are answered with "secrets come from files".
    """
    problems = []
    for err in exc.errors():
        loc = (*prefix, *err["loc"])
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            last = loc[-1] if loc else ""
            if isinstance(last, str) and last in _INLINE_SECRET_KEYS:
                message = (
                    "secrets come from files, never inline in YAML: "
                    f"use {_INLINE_SECRET_KEYS[last]}"
                )
            else:
                message = "unknown key"
        elif err["type"] == "missing":
            message = "required key is missing"
        problems.append((key_path(loc), message.removeprefix("Value error, ")))
    return problems


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error on one line (PyYAML's own message spans several, quoting the source)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        context = f"{exc.context}: " if exc.context else ""
        return f"not valid YAML{where}: {context}{exc.problem}"
    return "not valid YAML: " + " ".join(str(exc).split())


# --- files ----------------------------------------------------------------------------------


def _base_dir(info: ValidationInfo) -> Path:
    context = info.context or {}
    base = context.get("base_dir")
    return Path(base) if base is not None else Path.cwd()


def _resolve(value: Path, info: ValidationInfo) -> Path:
    # Relative to the config file, not the working directory of whoever starts the service.
    return value if value.is_absolute() else _base_dir(info) / value


def _readable_text(path: Path) -> str:
    """The file's text; `ValueError` with the reason (never the content) otherwise."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, not a file") from None
    except PermissionError:
        raise ValueError(f"{path}: not readable by this user (uid {os.getuid()})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None


def read_secret(path: Path) -> str:
    """A secret file's content without surrounding whitespace; `ConfigError` if unusable.

    The message names the file and the reason, never the content.
    """
    try:
        value = _readable_text(path).strip()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not value:
        raise ConfigError(f"{path}: is empty")
    return value


def _secret_file(value: Path, info: ValidationInfo) -> Path:
    path = _resolve(value, info)
    text = _readable_text(path).strip()
    if not text:
        raise ValueError(f"{path}: is empty")
    if "\n" in text:
        raise ValueError(f"{path}: must hold one line (the secret), not several")
    return path


def _bearer_token_file(value: Path, info: ValidationInfo) -> Path:
    path = _secret_file(value, info)
    if not _BEARER_TOKEN.match(_readable_text(path).strip()):
        raise ValueError(
            f"{path}: a bearer token may hold only letters, digits and -._~+/ "
            "(and trailing =), or no client can send it"
        )
    return path


def _readable_file(value: Path, info: ValidationInfo) -> Path:
    path = _resolve(value, info)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{path}: not readable by this user (uid {os.getuid()})")
    return path


def _directory(value: Path, info: ValidationInfo) -> Path:
    path = _resolve(value, info)
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ValueError(f"{path}: not readable by this user (uid {os.getuid()})")
    return path


def _zuliprc_file(value: Path, info: ValidationInfo) -> Path:
    path = _resolve(value, info)
    text = _readable_text(path)
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text, source=str(path))
    except configparser.Error as exc:
        # configparser quotes the offending line, which may be the key: say where, not what.
        line = getattr(exc, "lineno", None)
        where = f" (line {line})" if line else ""
        raise ValueError(f"{path}: not a zuliprc file{where}: expected an [api] section") from None
    if not parser.has_section("api"):
        raise ValueError(f"{path}: has no [api] section (email, key, site)")
    missing = [k for k in ("email", "key", "site") if not parser.get("api", k, fallback="")]
    if missing:
        raise ValueError(f"{path}: [api] lacks {', '.join(missing)}")
    site = urlsplit(parser.get("api", "site"))
    if site.scheme not in ("http", "https") or not site.hostname:
        raise ValueError(f"{path}: [api] site must be an http:// or https:// URL")
    if site.scheme == "http" and not _loopback(site.hostname):
        # The bot's key goes with every request (basic auth): never in clear over a network.
        raise ValueError(f"{path}: [api] site must be https:// (http:// only on loopback)")
    if parser.get("api", "insecure", fallback="false").strip().lower() != "false":
        raise ValueError(
            f"{path}: [api] insecure would turn TLS verification off: remove it (give a "
            "private CA as cert_bundle instead)"
        )
    return path


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError("secrets come from files, never inline in YAML: no credentials in the URL")
    return value.rstrip("/")


_EMAIL = re.compile(r"^[^@\s,]+@[^@\s,]+$")


def _email(value: str) -> str:
    # Zulip's own check is the judge; this one catches typos at start-up (a missing @, a
    # list pasted as one string).
    if not _EMAIL.match(value):
        raise ValueError(f"{value!r} is not an e-mail address (one Zulip user per entry)")
    return value


SecretFile = Annotated[Path, AfterValidator(_secret_file)]
BearerTokenFile = Annotated[Path, AfterValidator(_bearer_token_file)]


def _writable_directory(value: Path, info: ValidationInfo) -> Path:
    path = _resolve(value, info)
    existing = path if path.exists() else path.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: cannot write there (uid {os.getuid()})")
    return path


ReadableFile = Annotated[Path, AfterValidator(_readable_file)]
WritableDirectory = Annotated[Path, AfterValidator(_writable_directory)]
Directory = Annotated[Path, AfterValidator(_directory)]
ZuliprcFile = Annotated[Path, AfterValidator(_zuliprc_file)]


# --- models ---------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _user_id(value: str) -> str:
    # RFC 7617: the user-id ends at the first colon; one inside could never match.
    if ":" in value or value != value.strip():
        raise ValueError("must not contain ':' or surrounding spaces")
    return value


UserId = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_user_id)]
"""A basic-auth user name (the webhook's or admin's `basic_auth`, the page's `ui`)."""


class BasicAuthSettings(_Strict):
    """Basic auth: a user name in the YAML, the password in a file."""

    username: UserId
    password_file: SecretFile


BCRYPT_HASH = re.compile(r"^\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}$")
"""A bcrypt hash as `htpasswd -nBC 10` writes it (the exporter's web config takes the same)."""


def _ui_password_file(value: Path, info: ValidationInfo) -> Path:
    path = _secret_file(value, info)
    text = _readable_text(path).strip()
    if text.startswith("$2") and not BCRYPT_HASH.match(text):
        # The message never echoes the file's content.
        raise ValueError(
            f"{path}: starts like a bcrypt hash but is not one ($2b$, $2a$ or $2y$, cost "
            "04-31, 60 characters): see `htpasswd -nBC 10 \"\" | tr -d ':\\n'`"
        )
    return path


class UiSettings(_Strict):
    """The read-only page's credential: basic auth (a browser sends it by itself).

    `password_file` holds the password, or its bcrypt hash (then the password never sits on
    the remediator's disk; a changed hash needs a restart, a changed password does not).
    """

    username: UserId = "ui"
    password_file: Annotated[Path, AfterValidator(_ui_password_file)]


class AuthSettings(_Strict):
    """Credentials clients must present: a bearer token or basic auth, exactly one."""

    bearer_token_file: BearerTokenFile | None = None
    basic_auth: BasicAuthSettings | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> AuthSettings:
        if (self.bearer_token_file is None) == (self.basic_auth is None):
            raise ValueError("give exactly one of bearer_token_file, basic_auth")
        return self

    def secret_file(self) -> Path:
        """The file holding the secret (the token, or the basic-auth password)."""
        if self.basic_auth is not None:
            return self.basic_auth.password_file
        assert self.bearer_token_file is not None
        return self.bearer_token_file


class Limits(_Strict):
    """The rails' limits, over all replicas (`remediator.journal.rails`).

    Caps: runs acting at once, disruptive runs started per hour. A run refused for a passing
    reason waits at most `max_wait_seconds` (then ends `expired`, reported); one that waits
    past `wait_report_after_seconds` gets a short report saying why it waits.
    """

    max_concurrent_runs: int = Field(default=4, ge=1, le=1000)
    max_runs_per_hour: int = Field(default=30, ge=1, le=100_000)
    max_wait_seconds: float = Field(default=3600.0, ge=1, le=7 * 86400)
    wait_report_after_seconds: float = Field(default=300.0, ge=0, le=7 * 86400)


class ZulipSettings(_Strict):
    """Where reports go: a Zulip stream, the topic chosen by the alert's `category` label."""

    zuliprc: ZuliprcFile
    stream: str = Field(min_length=1, max_length=_ZULIP_NAME_MAX)
    topics: dict[str, Annotated[str, Field(min_length=1, max_length=_ZULIP_NAME_MAX)]] = {}
    default_topic: str = Field(default="gpu-fleet", min_length=1, max_length=_ZULIP_NAME_MAX)
    escalate_to: list[Annotated[str, AfterValidator(_email)]] = Field(default=[], max_length=50)
    grafana_url: Annotated[str, AfterValidator(_http_url)] | None = None
    alertmanager_url: Annotated[str, AfterValidator(_http_url)] | None = None

    @field_validator("topics")
    @classmethod
    def _categories(cls, value: dict[str, str]) -> dict[str, str]:
        for category in value:
            if not _LABEL_VALUE.match(category):
                raise ValueError(f"category {category!r} is not a plain label value")
        return value


_PROGRAM = re.compile(r"^[A-Za-z0-9_./+-]{1,4096}$")
_NODE_ARG = re.compile(r"^[A-Za-z0-9_./+=:@-]{1,4096}$")


def _program(value: str) -> str:
    # A program name or path, run without a shell: keep it to characters that need no quoting.
    if not _PROGRAM.match(value) or value.startswith("-"):
        raise ValueError(f"{value!r} is not a program name or path")
    return value


AllowedUrl = Annotated[str, AfterValidator(_http_url)]
ProgramName = Annotated[str, AfterValidator(_program)]


class SshClientSettings(_Strict):
    """The OpenSSH client that reaches `gpu-fleet-node` on the hosts (`ssh:`)."""

    binary: ProgramName = "ssh"
    identity_file: ReadableFile | None = None
    known_hosts_file: ReadableFile | None = None
    connect_timeout_seconds: int = Field(default=10, ge=1, le=300)


class HttpRequestSettings(_Strict):
    """`http_request:` the only URLs the `http_request` action may call (exact match)."""

    allowed_urls: list[AllowedUrl] = Field(default=[], max_length=200)


def _redis_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError("must be a redis://, rediss:// or unix:// URL")
    if parts.password is not None:
        raise ValueError(
            "secrets come from files, never inline in YAML: give the password as password_file"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError("must name a host")
    return value


def _key_pattern(value: str) -> str:
    if not value or len(value) > 512 or any(c.isspace() for c in value):
        raise ValueError(f"{value!r}: a key pattern is a non-empty glob without spaces")
    if value.strip("*?") == "":
        raise ValueError(f"{value!r} would allow every key: name a prefix")
    return value


RedisUrl = Annotated[str, AfterValidator(_redis_url)]
KeyPattern = Annotated[str, AfterValidator(_key_pattern)]


class RedisSettings(_Strict):
    """`redis:` where `redis_delete` works, and the only keys it may delete."""

    url: RedisUrl
    password_file: SecretFile | None = None
    allowed_key_patterns: list[KeyPattern] = Field(min_length=1, max_length=100)


class PowerCapSettings(_Strict):
    """`power_cap:` how often the engine checks whether a lowered power cap may be restored."""

    check_interval_seconds: float = Field(default=60.0, ge=1, le=3600)


def parse_listen(value: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` → `(host, port)`; raises `ValueError`."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError("must be host:port or [v6]:port (the host is required)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address") from None
    else:
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            if not _HOSTNAME.match(host):
                raise ValueError(f"{host!r} is not an IP address or a host name") from None
    # Port 0 lets the kernel pick one (tests); the server reports the port it bound.
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"port {port_text!r} must be a number from 0 to 65535")
    return host, int(port_text)


class RemediatorConfig(_Strict):
    """The whole config file, validated."""

    listen: str = DEFAULT_LISTEN
    roster: ReadableFile = Field(default=DEFAULT_ROSTER_PATH, validate_default=True)
    journal: str = DEFAULT_JOURNAL
    auth: AuthSettings
    admin: AuthSettings
    prometheus_url: str = DEFAULT_PROMETHEUS_URL
    playbooks_dir: Directory | None = None
    dry_run: bool = False
    zulip: ZulipSettings | None = None
    # Without a zulip section: the reports as Markdown files here (remediator/notify/files.py).
    reports_dir: WritableDirectory | None = None
    replica_id: str = Field(default_factory=socket.gethostname, validate_default=True)
    workers: int = Field(default=4, ge=1, le=64)
    retention_days: int = Field(default=30, ge=1, le=3650)
    limits: Limits = Limits()
    lock_ttl_seconds: float = Field(default=900.0, ge=10, le=86400)
    dedupe_window_seconds: float = Field(default=600.0, ge=0, le=86400)
    # TLS (and headers, and basic auth for /metrics) of the listener: the exporter's
    # --web.config.file format, checked at load by the exporter's own code (remediator/front.py).
    web_config_file: ReadableFile | None = None
    # The read-only page (remediator/ui.py); without it /ui/ answers 404.
    ui: UiSettings | None = None
    ssh: SshClientSettings = SshClientSettings()
    node_command: list[str] = Field(default=["gpu-fleet-node"], min_length=1, max_length=16)
    http_request: HttpRequestSettings = HttpRequestSettings()
    redis: RedisSettings | None = None
    power_cap: PowerCapSettings = PowerCapSettings()

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        parse_listen(value)
        return value

    @field_validator("node_command")
    @classmethod
    def _node_command(cls, value: list[str]) -> list[str]:
        # Run without a shell: words that need no quoting, the first one a program.
        _program(value[0])
        for word in value[1:]:
            if not _NODE_ARG.match(word):
                raise ValueError(f"{word!r}: use plain words (letters, digits, _./+=:@-)")
        return value

    @field_validator("journal")
    @classmethod
    def _journal(cls, value: str) -> str:
        try:
            url = make_url(value)
        except ArgumentError:
            raise ValueError("not a SQLAlchemy URL (sqlite:////path or postgresql://…)") from None
        backend = url.get_backend_name()
        if backend not in ("sqlite", "postgresql"):
            raise ValueError(f"backend {backend!r}: the journal runs on sqlite or postgresql")
        if url.password is not None:
            raise ValueError(
                "secrets come from files, never inline in YAML: drop the password from the URL "
                "and give libpq a passfile (`?passfile=/etc/gpu-fleet/pgpass` or ~/.pgpass)"
            )
        database = url.database or ""
        in_memory = (
            database in ("", ":memory:")
            or database.startswith("file::memory:")
            or "mode=memory" in database
            or url.query.get("mode") == "memory"
        )
        if backend == "sqlite" and in_memory:
            raise ValueError(
                "a SQLite journal needs a file (sqlite:////var/lib/…): it must survive a restart"
            )
        return value

    @field_validator("prometheus_url")
    @classmethod
    def _prometheus_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.username is not None or parts.password is not None:
            raise ValueError(
                "secrets come from files, never inline in YAML: no credentials in the URL"
            )
        return value.rstrip("/")

    @field_validator("replica_id")
    @classmethod
    def _replica_id(cls, value: str) -> str:
        if not _REPLICA_ID.match(value):
            raise ValueError(
                f"{value!r}: use letters, digits, '_', '.', '-' (set replica_id when the "
                "hostname is not such a name)"
            )
        return value

    def listen_address(self) -> tuple[str, int]:
        """`listen` as `(host, port)`."""
        return parse_listen(self.listen)


# --- loading --------------------------------------------------------------------------------


def _same_secret_problem(data: Mapping[str, Any], base_dir: Path) -> str | None:
    """Why `admin` may not be used with `auth` (same file or same secret), or None."""
    context = {"base_dir": base_dir}
    try:
        webhook = AuthSettings.model_validate(data.get("auth"), context=context)
        admin = AuthSettings.model_validate(data.get("admin"), context=context)
    except ValidationError:
        return None  # each section's own problems are reported by the full validation
    webhook_file, admin_file = webhook.secret_file(), admin.secret_file()
    try:
        same_file = os.path.samefile(webhook_file, admin_file)
    except OSError:
        same_file = webhook_file == admin_file
    if same_file:
        return (
            f"uses the same file as auth ({admin_file}): the admin API needs its own secret, "
            "not Alertmanager's"
        )
    try:
        webhook_secret, admin_secret = read_secret(webhook_file), read_secret(admin_file)
    except ConfigError:
        return None  # the file vanished in between: the next start reports it
    if _same(webhook_secret, admin_secret):
        return (
            f"its secret ({admin_file}) is the same as auth's ({webhook_file}): the admin API "
            "needs its own secret, not Alertmanager's"
        )
    return None


def _ui_secret_problems(data: Mapping[str, Any], base_dir: Path) -> list[str]:
    """Why `ui`'s password may not be used: the same file or secret as `auth` or `admin`."""
    if data.get("ui") is None:
        return []
    context = {"base_dir": base_dir}
    try:
        ui = UiSettings.model_validate(data.get("ui"), context=context)
    except ValidationError:
        return []  # its own problems are reported by the full validation
    try:
        page_secret = read_secret(ui.password_file)
    except ConfigError:
        return []
    problems = []
    for key in ("auth", "admin"):
        try:
            other = AuthSettings.model_validate(data.get(key), context=context)
            other_secret = read_secret(other.secret_file())
        except (ValidationError, ConfigError):
            continue
        try:
            same_file = os.path.samefile(ui.password_file, other.secret_file())
        except OSError:
            same_file = ui.password_file == other.secret_file()
        if BCRYPT_HASH.match(page_secret):
            import bcrypt  # noqa: PLC0415 - only a hashed page password needs it

            secret = other_secret.encode()
            same = len(secret) <= 72 and bcrypt.checkpw(secret, page_secret.encode())
        else:
            same = _same(page_secret, other_secret)
        if same_file or same:
            problems.append(
                f"the page's password is {key}'s secret ({other.secret_file()}): the page "
                f"needs its own, or a browser would hold {key}'s"
            )
    return problems


def load_config(path: Path) -> RemediatorConfig:
    """Read and validate the config file; `ConfigError` lists every problem, one per line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{path}: cannot read: {reason}") from None
    try:
        data = load_strict(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: {yaml_problem(exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: (top level): must be a mapping of config keys")
    base_dir = path.parent.resolve()
    problems: list[tuple[str, str]] = []
    config: RemediatorConfig | None = None
    try:
        config = RemediatorConfig.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        problems.extend(validation_problems(exc))
    same = _same_secret_problem(data, base_dir)
    if same is not None:
        problems.append(("admin", same))
    problems += [("ui.password_file", line) for line in _ui_secret_problems(data, base_dir)]
    if config is not None and config.web_config_file is not None:
        from fleet.webconfig import WebConfigError, load_web_config  # noqa: PLC0415

        try:
            load_web_config(config.web_config_file)
        except WebConfigError as exc:
            problems += [("web_config_file", line) for line in exc.problems]
    if problems or config is None:
        raise ConfigError("\n".join(f"{path}: {where}: {message}" for where, message in problems))
    return config


# --- credentials ----------------------------------------------------------------------------


def _same(a: str, b: str) -> bool:
    """Constant-time equality of two secrets, their lengths included.

    `hmac.compare_digest` takes time independent of the contents but not of the lengths;
    comparing SHA-256 digests (always 32 bytes) hides the length of the secret too.
    """
    digest_a = hashlib.sha256(a.encode("utf-8", "surrogatepass")).digest()
    digest_b = hashlib.sha256(b.encode("utf-8", "surrogatepass")).digest()
    return hmac.compare_digest(digest_a, digest_b)


SECRET_GRACE_SECONDS = 300.0
"""After a secret file changes, the previous secret is still accepted this long: Alertmanager
drops a notification answered 401, so a rotation must not race its config reload."""
_SECRET_RECHECK_SECONDS = 1.0


class Credential:
    """One secret that a client must present in its `Authorization` header.

    `secret` is the bearer token or the basic-auth password; it is left out of `repr` so a
    log line or a traceback that shows the object shows no secret. The secret is re-read when
    its file (`source`) changes — looked at no more than once a second — and the previous one
    stays valid for `grace_seconds`, so rotating a token needs no restart and loses nothing. A
    file that became unreadable or empty keeps the secret in force (and says so in the log).
    """

    def __init__(
        self,
        scheme: Literal["bearer", "basic"],
        source: Path,
        username: str | None = None,
        secret: str = "",
        *,
        grace_seconds: float = SECRET_GRACE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheme = scheme
        self.source = source
        self.username = username
        self.grace_seconds = grace_seconds
        self._clock = clock
        self._secret = secret
        self._previous: str | None = None
        self._previous_until = 0.0
        self._stamp = self._file_stamp()
        self._checked = clock()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Credential({self.scheme!r}, {str(self.source)!r}, username={self.username!r})"

    @property
    def secret(self) -> str:
        """The secret in force (after a change of its file, the new one)."""
        self._refresh()
        return self._secret

    @property
    def www_authenticate(self) -> str:
        """The `WWW-Authenticate` value of a 401 answer for this credential."""
        if self.scheme == "bearer":
            return f'Bearer realm="{REALM}"'
        return f'Basic realm="{REALM}", charset="UTF-8"'

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            info = self.source.stat()
        except OSError:
            return None
        return (info.st_ino, info.st_size, info.st_mtime_ns)

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._checked < _SECRET_RECHECK_SECONDS:
            return
        with self._lock:
            self._checked = now
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return
            self._stamp = stamp
            try:
                fresh = read_secret(self.source)
            except ConfigError as exc:
                _log.error("secret file %s: %s; the secret in force stays", self.source, exc)
                return
            if fresh != self._secret:
                _log.info("secret file %s changed: the new secret is in force, the previous one "
                          "for %.0f s more", self.source, self.grace_seconds)  # fmt: skip
                self._previous, self._previous_until = self._secret, now + self.grace_seconds
                self._secret = fresh

    def check_authorization_header(self, value: str | None) -> bool:
        """Whether an `Authorization` header value carries this credential.

        Secrets are compared in constant time; for basic auth both the user name and the
        password are always compared, so the time does not tell which one was wrong.
        """
        current = self.secret
        previous = self._previous if self._clock() < self._previous_until else None
        return self._carries(value, current) or (
            previous is not None and self._carries(value, previous)
        )

    def _carries(self, value: str | None, secret: str) -> bool:
        if not value or not secret:
            return False
        scheme, _, rest = value.strip().partition(" ")
        rest = rest.strip()
        if self.scheme == "bearer":
            return scheme.lower() == "bearer" and _same(rest, secret)
        if scheme.lower() != "basic":
            return False
        try:
            decoded = base64_decode(rest)
        except ValueError:
            return False
        user, sep, password = decoded.partition(":")
        if not sep:
            return False
        user_ok = _same(user, self.username or "")
        password_ok = _same(password, secret)
        return user_ok & password_ok


def base64_decode(text: str) -> str:
    """Strict base64 to UTF-8 text; `ValueError` for anything else."""
    try:
        return base64.b64decode(text, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError("not base64 of UTF-8 text") from None


def credential_from(settings: AuthSettings) -> Credential:
    """The credential an `auth`/`admin` section describes, its secret read from the file."""
    if settings.basic_auth is not None:
        basic = settings.basic_auth
        return Credential(
            "basic", basic.password_file, basic.username, read_secret(basic.password_file)
        )
    assert settings.bearer_token_file is not None
    return Credential(
        "bearer", settings.bearer_token_file, None, read_secret(settings.bearer_token_file)
    )


@dataclass(frozen=True)
class Secrets:
    """The credentials of the two endpoints: Alertmanager's webhook and the admin API."""

    webhook: Credential
    admin: Credential


def load_secrets(config: RemediatorConfig) -> Secrets:
    """Read both secrets; `ConfigError` if a file became unusable since `load_config`."""
    return Secrets(webhook=credential_from(config.auth), admin=credential_from(config.admin))
