"""TLS and basic auth for the exporter's endpoint, from a `--web.config.file`.

The file has the format of the Prometheus exporter-toolkit (`docs/web-configuration.md` in
prometheus/exporter-toolkit), the one node_exporter's `--web.config.file` takes, so one file can
secure every exporter of a host:

    tls_server_config:
      cert_file: /etc/gpu-fleet/exporter.crt       # relative paths: from the file's directory
      key_file: /etc/gpu-fleet/exporter.key
      client_auth_type: RequireAndVerifyClientCert  # optional; default NoClientCert
      client_ca_file: /etc/gpu-fleet/scrapers-ca.crt
      min_version: TLS12                            # default TLS12; max_version default TLS13
    http_server_config:
      headers:
        X-Content-Type-Options: nosniff
    basic_auth_users:                               # user: bcrypt hash
      prometheus: $2b$10$...

Manual check: `promtool check web-config FILE` (Debian's prometheus package) judges the file the
way node_exporter would; `gpu-fleet-exporter --web.config.file FILE --once` judges it the way
this exporter does (exit status 2 and one `FILE: key.path: message` line per problem).

The whole file is validated once, at start-up; a change to it needs a restart. The certificate,
key and client CA files are different: they are re-read on the next connection after they change
on disk, so a rotated certificate needs no restart (exporter-toolkit re-reads them on every
handshake; comparing the files' stat first is the same effect for less work).

Where the format asks for something Python's `ssl` module can do, it is honoured; where it
cannot be done with the same meaning, the key is refused at start-up with the reason, never
dropped silently, because a weaker setting than the file says would be a silent security hole:

- `cipher_suites` (Go names) are mapped to OpenSSL names and honoured for TLS 1.2. TLS 1.3
  suites are not configurable, in Go's crypto/tls either: naming one is accepted (a node_exporter
  file stays valid) and the start-up log says it has no effect.
- `curve_preferences`: Python 3.11 can set exactly one key-exchange group
  (`SSLContext.set_ecdh_curve`), so a one-curve list is honoured and a longer one refused (a
  preference order with fallbacks cannot be expressed).
- `client_auth_type` `RequestClientCert` and `RequireAnyClientCert` accept a client certificate
  without verifying it; Python's `ssl` verifies every certificate it asks for, and the toolkit's
  own docs call those modes insecure: refused, use `RequireAndVerifyClientCert`.
- `min_version`/`max_version` `TLS10`/`TLS11`: obsolete (RFC 8996), refused.
- `http_server_config.http2`: this server speaks HTTP/1.1 only; the key is accepted (Prometheus
  falls back to HTTP/1.1) and `http2: true` is reported in the start-up log.
- Inline PEM (`cert`, `key`, `client_ca`), `client_allowed_sans` and `rate_limit`: refused. An
  inline key is a secret inside YAML; inline PEM cannot be rotated without a restart; SAN
  pinning and rate limits are not implemented here.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
import ssl
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import NoReturn, TypeVar

import bcrypt
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from fleet.yamlfile import load_strict

log = logging.getLogger(__name__)

REALM = "gpu-fleet-exporter"
WWW_AUTHENTICATE = f'Basic realm="{REALM}"'

# Go's tls.CipherSuites() names (the ones exporter-toolkit accepts) → OpenSSL's names.
_TLS12_CIPHERS = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
}
_TLS13_CIPHERS = (
    "TLS_AES_128_GCM_SHA256",
    "TLS_AES_256_GCM_SHA384",
    "TLS_CHACHA20_POLY1305_SHA256",
)
# Go's curve names (exporter-toolkit's `curves` table) → OpenSSL's group names.
_CURVES = {
    "CurveP256": "prime256v1",
    "CurveP384": "secp384r1",
    "CurveP521": "secp521r1",
    "X25519": "X25519",
}
_VERSIONS = {"TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
# The headers exporter-toolkit lets a file set, with the values it allows (None: any). Kept the
# same on purpose, so a file means the same to every exporter of the host.
_HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
_SECTIONS = ("tls_server_config", "http_server_config", "basic_auth_users")
_REFUSED_TOP = {
    "rate_limit": "not supported by gpu-fleet-exporter: remove it (Prometheus already paces "
    "its scrapes by scrape_interval)",
}
# `$2a$`, `$2b$` or `$2y$`, a two-digit cost 04-31, then 22 characters of salt and 31 of hash.
_BCRYPT = re.compile(r"^\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}$")
# bcrypt reads only this many bytes of a password: a longer one is refused, never truncated,
# so that `password + anything` is not accepted.
_BCRYPT_MAX_PASSWORD = 72
HANDSHAKE_TIMEOUT_SECONDS = 10.0


class WebConfigError(Exception):
    """The web config file cannot be used; `problems` holds one `FILE: key.path: msg` each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = tuple(problems)


class TLSLoadError(Exception):
    """A TLS file or setting OpenSSL refused; `key` is the config key it came from."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class TLSSettings:
    """The validated `tls_server_config`, paths resolved."""

    cert_file: Path
    key_file: Path
    client_auth: ssl.VerifyMode = ssl.CERT_NONE
    client_ca_file: Path | None = None
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    max_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3
    ciphers: str | None = None
    """An OpenSSL cipher list (TLS 1.2), or None for OpenSSL's defaults."""
    curve: str | None = None
    """The one OpenSSL key-exchange group to use, or None for OpenSSL's defaults."""
    prefer_server_cipher_suites: bool = True

    def files(self) -> tuple[Path, ...]:
        """The files the context is built from (watched for rotation)."""
        extra = (self.client_ca_file,) if self.client_ca_file is not None else ()
        return (self.cert_file, self.key_file, *extra)


@dataclass(frozen=True)
class WebConfig:
    """A validated web config file."""

    source: Path
    tls: TLSSettings | None = None
    headers: tuple[tuple[str, str], ...] = ()
    """Extra headers for every response."""
    users: Mapping[str, str] = field(default_factory=dict)
    """Basic-auth users: name → bcrypt hash. Empty: no authentication."""
    notes: tuple[str, ...] = ()
    """Things the file asks for that have no effect here, for the start-up log."""

    def describe(self) -> str:
        """A one-line summary for the start-up log (never a secret)."""
        parts = []
        if self.tls is None:
            parts.append("TLS off")
        else:
            client = {
                ssl.CERT_NONE: "not asked",
                ssl.CERT_OPTIONAL: "verified if given",
                ssl.CERT_REQUIRED: "required",
            }[self.tls.client_auth]
            parts.append(f"TLS on (client certificates: {client})")
        count = len(self.users)
        parts.append(f"basic auth for {count} user(s)" if count else "basic auth off")
        return ", ".join(parts)


# --- the file's shape -------------------------------------------------------------------------


class _Strict(BaseModel):
    # strict: YAML already has types; `prefer_server_cipher_suites: "yes"` is a mistake.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _TLSServerConfig(_Strict):
    cert_file: str | None = None
    key_file: str | None = None
    client_auth_type: str = "NoClientCert"
    client_ca_file: str | None = None
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: list[str] | None = None
    curve_preferences: list[str] | None = None
    prefer_server_cipher_suites: bool = True
    # Keys of the format that are refused; typed loosely so that the refusal is what the user
    # reads, not a type error. The messages never echo the value: `key` would be a secret.
    cert: object = None
    key: object = None
    client_ca: object = None
    client_allowed_sans: object = None

    @field_validator("cert", "key", "client_ca")
    @classmethod
    def _no_inline_pem(cls, value: object) -> object:
        if value is not None:
            raise ValueError(
                "inline PEM is not supported: put it in a file and use the `_file` key "
                "(a key stays out of YAML, and a file can be rotated without a restart)"
            )
        return value

    @field_validator("client_allowed_sans")
    @classmethod
    def _no_san_pinning(cls, value: object) -> object:
        if value is not None:
            raise ValueError(
                "not supported by gpu-fleet-exporter: sign the scrapers' certificates with a "
                "dedicated CA and name it in client_ca_file instead"
            )
        return value


class _HTTPServerConfig(_Strict):
    http2: bool | None = None
    headers: dict[str, str] | None = None


# --- loading and validation -------------------------------------------------------------------


class _Problems:
    """Every problem found, each `FILE: key.path: message`."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines: list[str] = []

    def add(self, key: str | None, message: str) -> None:
        # No key for the file as a whole (`FILE: cannot read: ...`), as the roster's errors.
        prefix = f"{self.source}: {key}" if key is not None else self.source
        self.lines.append(f"{prefix}: {message}")

    def add_validation_error(self, prefix: str, exc: ValidationError) -> None:
        for err in exc.errors():
            path = ".".join([prefix, *(str(part) for part in err["loc"])])
            message = err["msg"]
            if err["type"] == "extra_forbidden":
                message = "unknown key (see exporter-toolkit's docs/web-configuration.md)"
            self.add(path, message.removeprefix("Value error, "))

    def fail(self) -> NoReturn:
        raise WebConfigError(self.lines)


def load_web_config(path: Path) -> WebConfig:
    """Read and validate a web config file, its certificate files included.

    Raises `WebConfigError` listing every problem, each as `FILE: key.path: message`.
    """
    problems = _Problems(str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        problems.add(None, f"cannot read: {getattr(exc, 'strerror', None) or exc}")
        problems.fail()
    try:
        data = load_strict(text)
    except yaml.YAMLError as exc:
        problems.add(None, f"not valid YAML: {exc}")
        problems.fail()
    return _parse(data, path, problems)


def parse_web_config(data: object, path: Path) -> WebConfig:
    """Validate already-loaded YAML data; relative paths are taken from `path`'s directory."""
    return _parse(data, path, _Problems(str(path)))


def _parse(data: object, path: Path, problems: _Problems) -> WebConfig:
    if data is None:
        data = {}  # an empty file: as exporter-toolkit, neither TLS nor auth
    if not isinstance(data, dict):
        problems.add("(top level)", "must be a mapping of " + ", ".join(_SECTIONS))
        problems.fail()
    for key in data:
        if key not in _SECTIONS:
            problems.add(str(key), _REFUSED_TOP.get(str(key), "unknown key"))

    notes: list[str] = []
    tls = None
    raw_tls = _section(
        _TLSServerConfig, data.get("tls_server_config"), "tls_server_config", problems
    )
    if raw_tls is not None:
        tls = _tls_settings(raw_tls, path.parent, problems, notes)
    headers: tuple[tuple[str, str], ...] = ()
    raw_http = _section(
        _HTTPServerConfig, data.get("http_server_config"), "http_server_config", problems
    )
    if raw_http is not None:
        headers = _headers(raw_http.headers or {}, problems)
        if raw_http.http2:
            notes.append(
                "http_server_config.http2: this server speaks HTTP/1.1 only (Prometheus "
                "falls back to it); the key has no effect"
            )
    users = _users(data.get("basic_auth_users"), problems)
    if users and raw_tls is None:
        # Allowed, as in exporter-toolkit (TLS may end at a proxy in front), but worth a line.
        notes.append(
            "basic_auth_users without tls_server_config: passwords cross the network in "
            "clear text unless a TLS proxy is in front"
        )
    if problems.lines:
        problems.fail()
    return WebConfig(source=path, tls=tls, headers=headers, users=users, notes=tuple(notes))


_M = TypeVar("_M", bound=BaseModel)


def _section(model: type[_M], value: object, name: str, problems: _Problems) -> _M | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        problems.add(name, "must be a mapping")
        return None
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        problems.add_validation_error(name, exc)
        bad = {err["loc"][0] for err in exc.errors() if err["loc"]}
    # Check the rest without the bad keys, so that their problems are reported too (a typo in
    # one key must not hide an unreadable file named by another). What this finds is only
    # ever reported: the start fails anyway.
    try:
        return model.model_validate({k: v for k, v in value.items() if k not in bad})
    except ValidationError:
        return None


def _resolve(base: Path, value: str) -> Path:
    # Relative to the config file's directory, as exporter-toolkit does (TLSConfig.SetDirectory),
    # so the answer does not depend on the working directory of the service.
    path = Path(value)
    return path if path.is_absolute() else base / path


def _tls_settings(
    raw: _TLSServerConfig, base: Path, problems: _Problems, notes: list[str]
) -> TLSSettings | None:
    p = "tls_server_config"
    before = len(problems.lines)
    files: dict[str, Path] = {}
    for key in ("cert_file", "key_file", "client_ca_file"):
        value = getattr(raw, key)
        if value is None:
            continue
        if not value:
            problems.add(f"{p}.{key}", "must not be empty")
            continue
        path = _resolve(base, value)
        try:
            path.read_bytes()
        except OSError as exc:
            problems.add(f"{p}.{key}", f"cannot read {path}: {exc.strerror or exc}")
        files[key] = path
    # Unlike exporter-toolkit, a tls_server_config without its pair is an error rather than
    # plain HTTP: a file that mentions TLS must never end up serving without it.
    for key in ("cert_file", "key_file"):
        if getattr(raw, key) is None:
            problems.add(f"{p}.{key}", "required: TLS needs both cert_file and key_file")

    client_auth = _CLIENT_AUTH.get(raw.client_auth_type)
    if raw.client_auth_type in ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert"):
        problems.add(
            f"{p}.client_auth_type",
            f"{raw.client_auth_type} accepts client certificates without verifying them, which "
            "Python's ssl cannot do (and the toolkit's docs call insecure): use "
            "RequireAndVerifyClientCert with client_ca_file",
        )
    elif client_auth is None:
        problems.add(f"{p}.client_auth_type", "must be one of " + ", ".join(_CLIENT_AUTH))
    elif client_auth != ssl.CERT_NONE and raw.client_ca_file is None:
        problems.add(
            f"{p}.client_ca_file",
            f"required with client_auth_type {raw.client_auth_type}: the CA that signs the "
            "scrapers' certificates",
        )
    elif client_auth == ssl.CERT_NONE and raw.client_ca_file is not None:
        problems.add(
            f"{p}.client_ca_file",
            "set without a client_auth_type that verifies client certificates "
            "(RequireAndVerifyClientCert or VerifyClientCertIfGiven)",
        )

    versions = {}
    for key in ("min_version", "max_version"):
        name = getattr(raw, key)
        if name in ("TLS10", "TLS11"):
            problems.add(f"{p}.{key}", f"{name} is obsolete (RFC 8996): use TLS12 or TLS13")
        elif name not in _VERSIONS:
            problems.add(f"{p}.{key}", "must be TLS12 or TLS13")
        else:
            versions[key] = _VERSIONS[name]
    if len(versions) == 2 and versions["min_version"] > versions["max_version"]:
        problems.add(
            f"{p}.min_version", f"{raw.min_version} is above max_version {raw.max_version}"
        )

    ciphers = []
    for index, name in enumerate(raw.cipher_suites or []):
        if name in _TLS12_CIPHERS:
            ciphers.append(_TLS12_CIPHERS[name])
        elif name in _TLS13_CIPHERS:
            notes.append(
                f"{p}.cipher_suites.{index}: {name} is a TLS 1.3 suite; TLS 1.3 suites are not "
                "configurable (nor in Go): it has no effect"
            )
        else:
            problems.add(
                f"{p}.cipher_suites.{index}",
                f"unknown cipher suite {name!r} (Go's names, e.g. "
                "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256)",
            )
    if ciphers and versions.get("min_version") == ssl.TLSVersion.TLSv1_3:
        notes.append(f"{p}.cipher_suites: min_version is TLS13, so they have no effect")

    curve = None
    curves = raw.curve_preferences or []
    for index, name in enumerate(curves):
        if name not in _CURVES:
            problems.add(
                f"{p}.curve_preferences.{index}",
                f"unknown curve {name!r}: one of " + ", ".join(_CURVES),
            )
    if len(curves) > 1:
        problems.add(
            f"{p}.curve_preferences",
            "Python's ssl can set only one curve (no preference order with fallbacks): "
            "list exactly one",
        )
    elif curves and curves[0] in _CURVES:
        curve = _CURVES[curves[0]]

    if len(problems.lines) > before:
        return None
    settings = TLSSettings(
        cert_file=files["cert_file"],
        key_file=files["key_file"],
        client_auth=client_auth if client_auth is not None else ssl.CERT_NONE,
        client_ca_file=files.get("client_ca_file"),
        min_version=versions["min_version"],
        max_version=versions["max_version"],
        ciphers=":".join(ciphers) or None,
        curve=curve,
        prefer_server_cipher_suites=raw.prefer_server_cipher_suites,
    )
    # Build the context once now, so that a bad PEM or a mismatched pair stops the start.
    try:
        build_ssl_context(settings)
    except TLSLoadError as exc:
        problems.add(f"{p}.{exc.key}", str(exc))
        return None
    return settings


def _headers(raw: dict[str, str], problems: _Problems) -> tuple[tuple[str, str], ...]:
    p = "http_server_config.headers"
    headers = []
    for name, value in raw.items():
        if name not in _HEADERS:
            problems.add(f"{p}.{name}", "this header cannot be set: one of " + ", ".join(_HEADERS))
        elif any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
            problems.add(f"{p}.{name}", "control characters are not allowed in a header value")
        elif (allowed := _HEADERS[name]) is not None and value not in allowed:
            problems.add(f"{p}.{name}", "must be one of " + ", ".join(allowed))
        elif value:  # blank: unset, as the format says
            headers.append((name, value))
    return tuple(headers)


def _users(value: object, problems: _Problems) -> dict[str, str]:
    p = "basic_auth_users"
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.add(p, "must be a mapping of user name to bcrypt hash")
        return {}
    users = {}
    for name, hashed in value.items():
        # The messages never echo a hash: it is not the password, but it can be attacked.
        if not isinstance(name, str) or not name:
            problems.add(f"{p}.{name}", "a user name must be a non-empty string")
        elif ":" in name:
            problems.add(f"{p}.{name}", "a user name cannot contain ':' (RFC 7617)")
        elif not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            problems.add(
                f"{p}.{name}",
                "not a bcrypt hash ($2b$, $2a$ or $2y$, cost 04-31, 60 characters): see "
                "`htpasswd -nBC 10 \"\" | tr -d ':\\n'`",
            )
        else:
            users[name] = hashed
    return users


# --- TLS --------------------------------------------------------------------------------------


_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----")
_PEM_KEY = re.compile(rb"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY-----")


class _EncryptedKeyError(Exception):
    pass


def _no_passphrase() -> bytes:
    # Without a callback, OpenSSL would prompt for a passphrase on the terminal and hang a
    # service; an encrypted key is refused instead (node_exporter cannot read one either).
    raise _EncryptedKeyError


def build_ssl_context(settings: TLSSettings) -> ssl.SSLContext:
    """A server-side context from the settings; raises `TLSLoadError` naming the bad key."""
    # OpenSSL says only "PEM lib" about either file: look for the PEM blocks first, so the
    # message names the file at fault.
    for key, path, marker, what in (
        ("cert_file", settings.cert_file, _PEM_CERT, "certificate"),
        ("key_file", settings.key_file, _PEM_KEY, "private key"),
    ):
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise TLSLoadError(key, f"cannot read {path}: {exc.strerror or exc}") from None
        if not marker.search(text):
            raise TLSLoadError(key, f"{path} holds no PEM {what}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = settings.min_version
    context.maximum_version = settings.max_version
    try:
        context.load_cert_chain(settings.cert_file, settings.key_file, password=_no_passphrase)
    except _EncryptedKeyError:
        raise TLSLoadError(
            "key_file",
            f"{settings.key_file} is encrypted: use an unencrypted key "
            "readable only by the exporter's user",
        ) from None
    except (ssl.SSLError, OSError) as exc:
        raise TLSLoadError(
            "cert_file",
            f"cannot load the certificate {settings.cert_file} with the key "
            f"{settings.key_file}: {_reason(exc)}",
        ) from None
    if settings.client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=settings.client_ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise TLSLoadError(
                "client_ca_file", f"cannot load {settings.client_ca_file}: {_reason(exc)}"
            ) from None
    # PROTOCOL_TLS_SERVER asks for no client certificate (CERT_NONE) unless told otherwise.
    context.verify_mode = settings.client_auth
    if settings.ciphers is not None:
        try:
            context.set_ciphers(settings.ciphers)
        except ssl.SSLError as exc:
            raise TLSLoadError(
                "cipher_suites", f"OpenSSL offers none of them: {_reason(exc)}"
            ) from None
    if settings.curve is not None:
        try:
            context.set_ecdh_curve(settings.curve)
        except (ssl.SSLError, ValueError) as exc:
            raise TLSLoadError("curve_preferences", f"OpenSSL refused it: {exc}") from None
    # Python sets OP_CIPHER_SERVER_PREFERENCE on server contexts already.
    if settings.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    return context


def _reason(exc: OSError) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).replace("_", " ").lower()
    return exc.strerror or str(exc)


_Signature = tuple[tuple[int, int, int, int] | None, ...]


class TLSContextProvider:
    """The server's SSL context, rebuilt when its files change on disk (certificate rotation).

    Each new connection asks `context()`, which compares the files' stat with the last build's
    (device, inode, mtime, size: an atomic `mv` changes the inode even within one mtime tick).
    A rebuild that fails, such as a certificate replaced before its key, keeps the previous
    context and is retried when the files change again: a rotation half done must not take the
    endpoint down.
    """

    def __init__(self, settings: TLSSettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._signature = self._stat()
        self._context = build_ssl_context(settings)
        self._failed: _Signature | None = None
        self.reloads = 0
        """Successful rebuilds since start (for tests and logs)."""

    def _stat(self) -> _Signature:
        signature: list[tuple[int, int, int, int] | None] = []
        for path in self._settings.files():
            try:
                st = os.stat(path)
            except OSError:
                signature.append(None)
            else:
                signature.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(signature)

    def context(self) -> ssl.SSLContext:
        """The context for a new connection, rebuilt first if the files changed."""
        signature = self._stat()
        with self._lock:
            if signature not in (self._signature, self._failed):
                try:
                    context = build_ssl_context(self._settings)
                except TLSLoadError as exc:
                    self._failed = signature
                    log.warning(
                        "TLS files changed but cannot be loaded (%s: %s); keeping the previous "
                        "certificate until they change again",
                        exc.key,
                        exc,
                    )
                else:
                    self._context = context
                    self._signature = signature
                    self._failed = None
                    self.reloads += 1
                    log.info("TLS files changed: certificate reloaded")
            return self._context


# --- basic auth -------------------------------------------------------------------------------


def parse_basic_authorization(value: str | None) -> tuple[str, str] | None:
    """`(user, password)` from an `Authorization: Basic …` header, or None."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except ValueError:  # binascii.Error, UnicodeDecodeError, a non-ASCII header
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None


def _bcrypt_cost(hashed: str) -> int:
    return int(hashed[4:6])


class AuthVerdict(Enum):
    """What a credential is worth: good, wrong (or none), or not checked now (bcrypt busy)."""

    OK = "ok"
    DENIED = "denied"
    BUSY = "busy"


class BasicAuthChecker:
    """Checks basic-auth credentials against bcrypt hashes, caching successes.

    bcrypt costs 50-300 ms a check by design, and Prometheus sends the same credentials every
    scrape: a success is cached, keyed by HMAC-SHA-256 of user, password and hash under a key
    made for this process. Never the password itself, and not a plain SHA-256 either: that
    would be a fast hash of the password in memory, undoing bcrypt's slowness for anyone who
    reads it. A failure is never cached, so every wrong guess pays bcrypt. The cache is bounded
    (least recently used goes first) and a changed hash can never hit an old entry.

    An unknown user is checked against a decoy hash of the highest configured cost, so the
    answer takes as long as for a real user (no user enumeration by timing); user names are
    compared with `hmac.compare_digest`. bcrypt runs one check at a time (as exporter-toolkit
    does), so a flood of wrong passwords costs one core of the GPU host, not all of them.

    `verdict(..., wait=False)` never waits for that one check: while it runs, credentials not in
    the cache are answered `BUSY` at once (the caller refuses them, 429), so the threads that
    serve good, cached credentials are never queued behind a flood of wrong ones.
    """

    def __init__(self, users: Mapping[str, str], *, cache_size: int = 256) -> None:
        if not users:
            raise ValueError("no users: basic auth is off, build no checker")
        self._users = [(name.encode(), hashed.encode()) for name, hashed in users.items()]
        cost = max(_bcrypt_cost(hashed) for hashed in users.values())
        self._decoy = bcrypt.hashpw(secrets.token_hex(16).encode(), bcrypt.gensalt(rounds=cost))
        self._hmac_key = secrets.token_bytes(32)
        self._cache: OrderedDict[bytes, None] = OrderedDict()
        self._cache_size = cache_size
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()
        self.bcrypt_checks = 0
        """bcrypt comparisons run so far (decoys included): what the cache saves."""

    def check_header(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries valid credentials."""
        return self.verdict(authorization) is AuthVerdict.OK

    def verdict(self, authorization: str | None, *, wait: bool = True) -> AuthVerdict:
        """What an `Authorization` header value is worth; `BUSY` only with `wait=False`."""
        credentials = parse_basic_authorization(authorization)
        if credentials is None:
            return AuthVerdict.DENIED
        return self._verdict(*credentials, wait=wait)

    def check(self, user: str, password: str) -> bool:
        """Whether `password` is `user`'s."""
        return self._verdict(user, password, wait=True) is AuthVerdict.OK

    def _verdict(self, user: str, password: str, *, wait: bool) -> AuthVerdict:
        denied = AuthVerdict.DENIED
        try:
            name = user.encode()
            secret = password.encode()
        except UnicodeEncodeError:  # a lone surrogate: no stored password has one
            return denied
        hashed = None
        for known, known_hash in self._users:
            # Every entry is compared (no early exit) so the time does not depend on which.
            if hmac.compare_digest(known, name):
                hashed = known_hash
        target = hashed if hashed is not None else self._decoy
        key = self._cache_key(name, secret, target)
        with self._cache_lock:
            # A dict lookup is not constant-time, but its key is an HMAC under a secret key:
            # its timing says nothing about the password.
            if key in self._cache:
                self._cache.move_to_end(key)
                return AuthVerdict.OK
        if len(secret) > _BCRYPT_MAX_PASSWORD:
            return denied
        if not self._bcrypt_lock.acquire(blocking=wait):
            return AuthVerdict.BUSY
        try:
            self.bcrypt_checks += 1
            try:
                matches = bcrypt.checkpw(secret, target)
            except ValueError:  # a password bcrypt refuses to compare
                matches = False
        finally:
            self._bcrypt_lock.release()
        if not matches or hashed is None:
            return denied
        with self._cache_lock:
            self._cache[key] = None
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return AuthVerdict.OK

    def _cache_key(self, name: bytes, secret: bytes, hashed: bytes) -> bytes:
        mac = hmac.new(self._hmac_key, digestmod=hashlib.sha256)
        for part in (name, secret, hashed):
            # Length-prefixed, so no two (user, password) splits give the same bytes.
            mac.update(len(part).to_bytes(8, "big"))
            mac.update(part)
        return mac.digest()
