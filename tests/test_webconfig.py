"""`--web.config.file`: validation, basic auth, TLS, client certificates, certificate rotation.

Real parts only: certificates made by the `openssl` CLI in the test (a CA, server and client
certificates), the real `gpu-fleet-exporter` process serving on 127.0.0.1, and real clients
(`http.client` with `ssl`, verification always on against the test CA, and `curl` when the
machine has it). `promtool check web-config` judges the example; it opens the certificate files
a config names (a missing file fails the check), so the test checks a copy pointing at
generated ones.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import os
import re
import select
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest
from prometheus_client import CollectorRegistry, Gauge

from exporter.http import MetricsServer
from fleet.webconfig import (
    WWW_AUTHENTICATE,
    BasicAuthChecker,
    TLSContextProvider,
    WebConfig,
    WebConfigError,
    load_web_config,
    parse_basic_authorization,
)

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "web-config.yml"
EXAMPLE_PASSWORD = "example-scrape-password"  # documented in the example's comments
EXPORTER = str(Path(sys.executable).parent / "gpu-fleet-exporter")
OPENSSL = shutil.which("openssl")
PROMTOOL = shutil.which("promtool")
CURL = shutil.which("curl")

# bcrypt's lowest cost keeps the tests fast; the checker treats every cost alike.
PASSWORD = "s3cret-scrape"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()

EXTENSIONS = """\
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


# --- certificates -----------------------------------------------------------------------------


def openssl(*args: str | Path) -> None:
    if OPENSSL is None:
        pytest.fail("the openssl CLI is missing: the TLS tests make their certificates with it")
    result = subprocess.run(
        [OPENSSL, *map(str, args)], capture_output=True, text=True, check=False, timeout=30
    )
    assert result.returncode == 0, result.stderr


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


class Pki:
    """A throw-away CA that issues EC P-256 server and client certificates."""

    def __init__(self, directory: Path, name: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.ca = Pair(directory / f"{name}.crt", directory / f"{name}.key")
        self._serial = 1000
        openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", self.ca.key, "-out", self.ca.cert, "-days", "2", "-subj", f"/CN={name}",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        (directory / "ext.cnf").write_text(EXTENSIONS)

    def issue(self, name: str, kind: str) -> Pair:
        self._serial += 1
        pair = Pair(self.dir / f"{name}.crt", self.dir / f"{name}.key")
        csr = self.dir / f"{name}.csr"
        openssl(
            "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", pair.key, "-out", csr, "-subj", f"/CN={name}",
        )  # fmt: skip
        openssl(
            "x509", "-req", "-in", csr, "-CA", self.ca.cert, "-CAkey", self.ca.key,
            "-set_serial", str(self._serial), "-days", "2", "-out", pair.cert,
            "-extfile", self.dir / "ext.cnf", "-extensions", kind,
        )  # fmt: skip
        return pair


@dataclass(frozen=True)
class Certs:
    ca: Path
    server: Pair
    server2: Pair  # the rotation's replacement, same CA
    client: Pair
    foreign_client: Pair  # signed by another CA


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    base = tmp_path_factory.mktemp("pki")
    pki = Pki(base / "ca", "test-ca")
    other = Pki(base / "other", "other-ca")
    return Certs(
        ca=pki.ca.cert,
        server=pki.issue("server", "server"),
        server2=pki.issue("server2", "server"),
        client=pki.issue("client", "client"),
        foreign_client=other.issue("foreign", "client"),
    )


def install(pair: Pair, directory: Path) -> Pair:
    """Copy a pair where a config can name it (and a test can replace it)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = Pair(directory / "exporter.crt", directory / "exporter.key")
    shutil.copyfile(pair.cert, target.cert)
    shutil.copyfile(pair.key, target.key)
    return target


def der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


# --- clients ----------------------------------------------------------------------------------


def client_context(ca: Path, client: Pair | None = None) -> ssl.SSLContext:
    """A client that verifies the server against the test CA (and never skips it)."""
    context = ssl.create_default_context(cafile=str(ca))
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    return context


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes
    peer_cert: bytes | None = None


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def get(
    port: int,
    path: str = "/metrics",
    *,
    context: ssl.SSLContext | None,
    headers: dict[str, str] | None = None,
) -> Answer:
    conn: http.client.HTTPConnection
    if context is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
    try:
        conn.request("GET", path, headers=headers or {})
        peer = None
        if isinstance(conn.sock, ssl.SSLSocket):
            peer = conn.sock.getpeercert(binary_form=True)
        response = conn.getresponse()
        return Answer(response.status, response.headers, response.read(), peer)
    finally:
        conn.close()


# --- the real exporter ------------------------------------------------------------------------


@dataclass
class Exporter:
    proc: subprocess.Popen[str]
    port: int


@pytest.fixture
def start_exporter(tmp_path: Path) -> Iterator[Callable[[Path], Exporter]]:
    """Start `gpu-fleet-exporter --web.config.file FILE` on 127.0.0.1, port 0."""
    sysfs = tmp_path / "sys"
    sysfs.mkdir()
    roster = tmp_path / "fleet.yaml"
    roster.write_text("hosts: {t: {address: 127.0.0.1}}\n")
    procs: list[subprocess.Popen[str]] = []

    def start(web_config: Path) -> Exporter:
        proc = subprocess.Popen(
            [
                EXPORTER, "--config", str(roster), "--host", "t", "--sysfs", str(sysfs),
                "--web.listen-address", "127.0.0.1:0", "--web.config.file", str(web_config),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        procs.append(proc)
        return Exporter(proc, _bound_port(proc))

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        assert proc.stderr is not None
        proc.stderr.close()


def _bound_port(proc: subprocess.Popen[str]) -> int:
    # The exporter logs the port it bound; port 0 leaves no race for a free port.
    assert proc.stderr is not None
    seen = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.2)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(r"serving /metrics on https?://[^ ]+:(\d+)", line)
        if match:
            return int(match.group(1))
    pytest.fail("the exporter did not start:\n" + "".join(seen))


def write_config(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


def tls_config(pair: Pair, *, extra_tls: str = "", rest: str = "") -> str:
    return (
        f"tls_server_config:\n  cert_file: {pair.cert}\n  key_file: {pair.key}\n{extra_tls}" + rest
    )


USERS = f"basic_auth_users:\n  prometheus: {HASH}\n"
HEADERS = "http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n"


def test_tls_and_basic_auth_with_a_real_exporter(
    certs: Certs, tmp_path: Path, start_exporter: Callable[[Path], Exporter]
) -> None:
    pair = install(certs.server, tmp_path / "tls")
    config = write_config(tmp_path / "web.yml", tls_config(pair, rest=USERS + HEADERS))
    exporter = start_exporter(config)
    context = client_context(certs.ca)

    for path in ("/metrics", "/"):
        answer = get(exporter.port, path, context=context)
        assert answer.status == 401, path
        assert answer.headers["WWW-Authenticate"] == WWW_AUTHENTICATE
        assert answer.headers["X-Content-Type-Options"] == "nosniff"
        assert b"gpufleet_" not in answer.body
    assert WWW_AUTHENTICATE == 'Basic realm="gpu-fleet-exporter"'
    wrong = get(exporter.port, context=context, headers=basic("prometheus", "guess"))
    assert wrong.status == 401 and b"gpufleet_" not in wrong.body
    unknown = get(exporter.port, context=context, headers=basic("mallory", PASSWORD))
    assert unknown.status == 401

    right = get(exporter.port, context=context, headers=basic("prometheus", PASSWORD))
    assert right.status == 200
    assert right.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert right.headers["X-Content-Type-Options"] == "nosniff"
    assert b"gpufleet_exporter_build_info{" in right.body
    assert right.peer_cert == der(certs.server.cert)
    landing = get(exporter.port, "/", context=context, headers=basic("prometheus", PASSWORD))
    assert landing.status == 200 and b'href="/metrics"' in landing.body

    # Plain HTTP on the TLS port: a clear 400, never the metrics.
    plain = get(exporter.port, context=None, headers=basic("prometheus", PASSWORD))
    assert plain.status == 400 and b"HTTPS server" in plain.body
    assert b"gpufleet_" not in plain.body
    # A client that does not trust the test CA refuses the server: it really is TLS.
    with pytest.raises(ssl.SSLCertVerificationError):
        get(exporter.port, context=ssl.create_default_context())
    # The server is still fine after all of that, and stops cleanly.
    assert get(exporter.port, context=context, headers=basic("prometheus", PASSWORD)).status == 200
    exporter.proc.send_signal(signal.SIGTERM)
    assert exporter.proc.wait(timeout=15) == 0


def test_curl_scrapes_with_tls_and_basic_auth(
    certs: Certs, tmp_path: Path, start_exporter: Callable[[Path], Exporter]
) -> None:
    if CURL is None:
        pytest.skip("curl is not installed (http.client covers the same ground above)")
    pair = install(certs.server, tmp_path / "tls")
    exporter = start_exporter(write_config(tmp_path / "web.yml", tls_config(pair, rest=USERS)))
    url = f"https://127.0.0.1:{exporter.port}/metrics"

    def curl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [CURL, "-sS", "--cacert", str(certs.ca), "-w", "\n%{http_code}", *args, url],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )

    ok = curl("-u", f"prometheus:{PASSWORD}")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.endswith("\n200") and "gpufleet_exporter_build_info{" in ok.stdout
    assert curl("-u", "prometheus:wrong").stdout.endswith("\n401")
    assert curl().stdout.endswith("\n401")


def test_client_certificates_required(
    certs: Certs, tmp_path: Path, start_exporter: Callable[[Path], Exporter]
) -> None:
    pair = install(certs.server, tmp_path / "tls")
    extra = f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {certs.ca}\n"
    exporter = start_exporter(write_config(tmp_path / "web.yml", tls_config(pair, extra_tls=extra)))

    answer = get(exporter.port, context=client_context(certs.ca, certs.client))
    assert answer.status == 200 and b"gpufleet_exporter_build_info{" in answer.body
    # Same client, same trust in the server, but no certificate: refused in the handshake
    # (TLS 1.3 clients learn it on their first read).
    with pytest.raises((OSError, http.client.HTTPException)):
        get(exporter.port, context=client_context(certs.ca))
    with pytest.raises((OSError, http.client.HTTPException)):
        get(exporter.port, context=client_context(certs.ca, certs.foreign_client))
    if CURL is not None:
        url = f"https://127.0.0.1:{exporter.port}/metrics"
        base = [CURL, "-sS", "-o", os.devnull, "-w", "%{http_code}", "--cacert", str(certs.ca)]
        with_cert = [*base, "--cert", str(certs.client.cert), "--key", str(certs.client.key)]
        good = subprocess.run(
            [*with_cert, url], capture_output=True, text=True, timeout=30, check=False
        )
        assert good.stdout == "200", good.stderr
        bad = subprocess.run([*base, url], capture_output=True, text=True, timeout=30, check=False)
        assert bad.returncode != 0 and bad.stdout != "200"


def test_a_rotated_certificate_is_served_without_a_restart(
    certs: Certs, tmp_path: Path, start_exporter: Callable[[Path], Exporter]
) -> None:
    pair = install(certs.server, tmp_path / "tls")
    exporter = start_exporter(write_config(tmp_path / "web.yml", tls_config(pair)))
    context = client_context(certs.ca)
    assert get(exporter.port, context=context).peer_cert == der(certs.server.cert)

    # The way cert-manager or certbot hooks do it: new files, renamed over the old ones.
    for source, target in ((certs.server2.cert, pair.cert), (certs.server2.key, pair.key)):
        staging = target.with_suffix(".new")
        shutil.copyfile(source, staging)
        os.replace(staging, target)
    answer = get(exporter.port, context=context)
    assert answer.status == 200
    assert answer.peer_cert == der(certs.server2.cert)
    assert exporter.proc.poll() is None


# --- in-process: what the context honours -----------------------------------------------------


@contextmanager
def serving(config: WebConfig, read_timeout_seconds: float = 10.0) -> Iterator[MetricsServer]:
    registry = CollectorRegistry()
    Gauge("probe_value", "A value to find in the answer.", registry=registry).set(1)
    server = MetricsServer(
        registry, "127.0.0.1", 0, web_config=config, read_timeout_seconds=read_timeout_seconds
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_versions_ciphers_and_curve_are_honoured(certs: Certs, tmp_path: Path) -> None:
    extra = "  max_version: TLS12\n  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256]\n"
    config = load_web_config(
        write_config(tmp_path / "web12.yml", tls_config(certs.server, extra_tls=extra))
    )
    with serving(config) as server:
        conn = http.client.HTTPSConnection(
            "127.0.0.1", server.port, timeout=10, context=client_context(certs.ca)
        )
        conn.request("GET", "/metrics")
        assert isinstance(conn.sock, ssl.SSLSocket)
        assert conn.sock.version() == "TLSv1.2"
        cipher = conn.sock.cipher()
        assert cipher is not None and cipher[0] == "ECDHE-ECDSA-AES128-GCM-SHA256"
        assert b"probe_value 1.0" in conn.getresponse().read()
        conn.close()

    # TLS 1.3, where the key-exchange group is independent of the certificate's curve (in
    # TLS 1.2 a client's groups also limit which ECDSA certificates it accepts).
    extra = "  min_version: TLS13\n  curve_preferences: [CurveP384]\n"
    config = load_web_config(
        write_config(tmp_path / "web13.yml", tls_config(certs.server, extra_tls=extra))
    )
    with serving(config) as server:
        p384 = client_context(certs.ca)
        p384.set_ecdh_curve("secp384r1")
        assert get(server.port, context=p384).status == 200
        x25519_only = client_context(certs.ca)
        x25519_only.set_ecdh_curve("X25519")
        with pytest.raises(ssl.SSLError):
            get(server.port, context=x25519_only)
        old = client_context(certs.ca)
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(ssl.SSLError):
            get(server.port, context=old)


def test_client_certificate_verified_if_given(certs: Certs, tmp_path: Path) -> None:
    extra = f"  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {certs.ca}\n"
    config = load_web_config(
        write_config(tmp_path / "web.yml", tls_config(certs.server, extra_tls=extra))
    )
    with serving(config) as server:
        assert get(server.port, context=client_context(certs.ca)).status == 200
        assert get(server.port, context=client_context(certs.ca, certs.client)).status == 200
        with pytest.raises((OSError, http.client.HTTPException)):
            get(server.port, context=client_context(certs.ca, certs.foreign_client))


def test_auth_and_headers_without_tls_and_on_every_answer(tmp_path: Path) -> None:
    body = USERS + (
        "http_server_config:\n  http2: false\n  headers:\n"
        "    X-Frame-Options: deny\n    Strict-Transport-Security: ''\n"
    )
    config = load_web_config(write_config(tmp_path / "web.yml", body))
    assert config.tls is None
    assert len(config.notes) == 1 and "clear text" in config.notes[0]  # and http2: false is not
    assert config.headers == (("X-Frame-Options", "deny"),)  # blank: unset, as the format says
    with serving(config) as server:
        assert server.scheme == "http"
        missing = get(server.port, "/nope", context=None, headers=basic("prometheus", PASSWORD))
        assert missing.status == 404 and missing.headers["X-Frame-Options"] == "deny"
        assert "Strict-Transport-Security" not in missing.headers
        denied = get(server.port, "/nope", context=None)
        assert denied.status == 401 and denied.headers["X-Frame-Options"] == "deny"


def test_a_half_done_rotation_keeps_the_previous_certificate(
    certs: Certs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pair = install(certs.server, tmp_path / "tls")
    config = load_web_config(write_config(tmp_path / "web.yml", tls_config(pair)))
    assert config.tls is not None
    provider = TLSContextProvider(config.tls)
    first = provider.context()
    assert provider.context() is first  # nothing changed: no rebuild

    shutil.copyfile(certs.server2.cert, pair.cert)  # the new certificate, the old key
    assert provider.context() is first
    assert provider.reloads == 0
    assert "keeping the previous certificate" in caplog.text
    assert provider.context() is first  # not retried until the files change again

    shutil.copyfile(certs.server2.key, pair.key)
    second = provider.context()
    assert second is not first and provider.reloads == 1


# --- validation -------------------------------------------------------------------------------


def problems_of(path: Path) -> tuple[str, ...]:
    with pytest.raises(WebConfigError) as info:
        load_web_config(path)
    return info.value.problems


def test_every_problem_is_reported_at_once_with_its_key_path(certs: Certs, tmp_path: Path) -> None:
    body = f"""\
tls_server_config:
  cert_fil: {certs.server.cert}
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: {tmp_path / "absent-ca.crt"}
  min_version: TLS13
  max_version: TLS12
http_server_config:
  headers:
    X-Powered-By: gpus
basic_auth_users:
  prometheus: plain-text-password
  alice: {HASH}
rate_limit: {{interval: 1s, burst: 5}}
extras: 1
"""
    config = write_config(tmp_path / "web.yml", body)
    problems = problems_of(config)
    expected = [
        "tls_server_config.cert_fil: unknown key",
        "tls_server_config.cert_file: required",
        "tls_server_config.key_file: required",
        "tls_server_config.client_ca_file: cannot read",
        "tls_server_config.min_version: TLS13 is above max_version TLS12",
        "http_server_config.headers.X-Powered-By: this header cannot be set",
        "basic_auth_users.prometheus: not a bcrypt hash",
        "rate_limit: not supported",
        "extras: unknown key",
    ]
    for fragment in expected:
        assert any(line.startswith(f"{config}: {fragment}") for line in problems), (
            fragment,
            problems,
        )
    assert len(problems) == len(expected), problems
    assert not any("plain-text-password" in line for line in problems)  # never echoed

    # The same through the command line's check: exit 2, every line, nothing on stdout.
    result = subprocess.run(
        [EXPORTER, "--check-config", "--sysfs", str(tmp_path), "--web.config.file", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and result.stdout == ""
    for line in problems:
        assert line in result.stderr


@pytest.mark.parametrize(
    ("tls_extra", "rest", "expected"),
    [
        (
            "  key: '-----BEGIN PRIVATE KEY-----SECRETVALUE'\n",
            "",
            "tls_server_config.key: inline PEM is not supported",
        ),
        ("  client_allowed_sans: [a]\n", "", "tls_server_config.client_allowed_sans: not supp"),
        ("  client_auth_type: RequireAnyClientCert\n", "", "client_auth_type: RequireAnyClie"),
        ("  client_auth_type: RequestClientCert\n", "", "client_auth_type: RequestClientCert"),
        ("  client_auth_type: Sometimes\n", "", "client_auth_type: must be one of"),
        (
            "  client_auth_type: RequireAndVerifyClientCert\n",
            "",
            "tls_server_config.client_ca_file: required with client_auth_type",
        ),
        ("  client_ca_file: CA\n", "", "tls_server_config.client_ca_file: set without"),
        ("  min_version: TLS11\n", "", "tls_server_config.min_version: TLS11 is obsolete"),
        ("  max_version: TLS14\n", "", "tls_server_config.max_version: must be TLS12 or TLS13"),
        ("  cipher_suites: [RC4]\n", "", "tls_server_config.cipher_suites.0: unknown cipher"),
        (
            "  curve_preferences: [X25519, CurveP256]\n",
            "",
            "tls_server_config.curve_preferences: Python's ssl can set only one curve",
        ),
        ("  curve_preferences: [P256]\n", "", "tls_server_config.curve_preferences.0: unknown"),
        ("  prefer_server_cipher_suites: 'yes'\n", "", "prefer_server_cipher_suites: Input should"),
        ("", "basic_auth_users:\n  'a:b': HASH\n", "basic_auth_users.a:b: a user name cannot"),
        ("", "basic_auth_users: [x]\n", "basic_auth_users: must be a mapping"),
        ("", "basic_auth_users:\n  x: $2b$99$" + "a" * 53 + "\n", "basic_auth_users.x: not a"),
        ("", "http_server_config:\n  headers:\n    X-Frame-Options: allow\n", "must be one of"),
        ("", "http_server_config:\n  http3: true\n", "http_server_config.http3: unknown key"),
    ],
)
def test_one_problem_named_by_its_key_path(
    certs: Certs, tmp_path: Path, tls_extra: str, rest: str, expected: str
) -> None:
    (tmp_path / "CA").write_text(certs.ca.read_text())
    body = tls_config(certs.server, extra_tls=tls_extra, rest=rest.replace("HASH", HASH))
    config = write_config(tmp_path / "web.yml", body)
    problems = problems_of(config)
    assert any(line.startswith(f"{config}: ") and expected in line for line in problems), problems
    assert not any("SECRETVALUE" in line for line in problems)


def test_unusable_tls_files(certs: Certs, tmp_path: Path) -> None:
    def problems_with(cert: Path | str, key: Path | str) -> str:
        config = write_config(tmp_path / "web.yml", tls_config(Pair(Path(cert), Path(key))))
        return "\n".join(problems_of(config))

    mismatch = problems_with(certs.server.cert, certs.server2.key)
    assert "tls_server_config.cert_file: cannot load the certificate" in mismatch
    assert "key values mismatch" in mismatch
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    assert "cert_file: " + f"{not_pem} holds no PEM certificate" in problems_with(
        not_pem, certs.server.key
    )
    assert "key_file: " + f"{not_pem} holds no PEM private key" in problems_with(
        certs.server.cert, not_pem
    )
    assert "tls_server_config.cert_file: cannot read" in problems_with(tmp_path, certs.server.key)
    empty_key = tls_config(certs.server).replace(str(certs.server.key), "''")
    empty = "\n".join(problems_of(write_config(tmp_path / "empty.yml", empty_key)))
    assert "tls_server_config.key_file: must not be empty" in empty
    encrypted = tmp_path / "encrypted.key"
    openssl(
        "pkey", "-in", certs.server.key, "-out", encrypted, "-aes256", "-passout", "pass:x"
    )  # fmt: skip
    assert "tls_server_config.key_file: " in problems_with(certs.server.cert, encrypted)
    assert "is encrypted" in problems_with(certs.server.cert, encrypted)
    duplicate = write_config(tmp_path / "dup.yml", f"basic_auth_users:\n  a: {HASH}\n  a: {HASH}\n")
    assert "duplicate key 'a'" in problems_of(duplicate)[0]
    assert "not valid YAML" in problems_of(write_config(tmp_path / "bad.yml", "a: [\n"))[0]
    assert "cannot read" in problems_of(tmp_path / "absent.yml")[0]


def test_relative_paths_notes_and_an_empty_file(certs: Certs, tmp_path: Path) -> None:
    install(certs.server, tmp_path)
    body = (
        "tls_server_config:\n  cert_file: exporter.crt\n  key_file: exporter.key\n"
        "  cipher_suites: [TLS_AES_128_GCM_SHA256]\nhttp_server_config:\n  http2: true\n"
    )
    # Relative to the file's directory, whatever the working directory.
    config = load_web_config(write_config(tmp_path / "web.yml", body))
    assert config.tls is not None
    assert config.tls.cert_file == tmp_path / "exporter.crt"
    assert config.tls.ciphers is None  # a TLS 1.3 suite is not configurable...
    assert any("TLS_AES_128_GCM_SHA256" in note for note in config.notes)  # ...and says so
    assert any("http2" in note for note in config.notes)
    assert config.describe() == "TLS on (client certificates: not asked), basic auth off"
    empty = load_web_config(write_config(tmp_path / "empty.yml", ""))
    assert empty.tls is None and not empty.users and not empty.headers


# --- basic auth -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("Basic " + base64.b64encode(b"u:p:q").decode(), ("u", "p:q")),
        ("basic " + base64.b64encode(b"u:").decode(), ("u", "")),
        ("Basic " + base64.b64encode("ü:ß".encode()).decode(), ("ü", "ß")),
        ("Basic " + base64.b64encode(b"no-colon").decode(), None),
        ("Basic not base64!", None),
        ("Basic " + base64.b64encode(b"\xff:x").decode(), None),
        ("Bearer abc", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_basic_authorization(header: str | None, expected: tuple[str, str] | None) -> None:
    assert parse_basic_authorization(header) == expected


def test_checker_caches_successes_only_and_spends_bcrypt_on_unknown_users() -> None:
    other_hash = bcrypt.hashpw(b"other", bcrypt.gensalt(rounds=4)).decode()
    checker = BasicAuthChecker({"prometheus": HASH, "grafana": other_hash}, cache_size=1)
    assert checker.check("prometheus", PASSWORD)
    assert checker.check("prometheus", PASSWORD)
    assert checker.check_header(basic("prometheus", PASSWORD)["Authorization"])
    assert checker.bcrypt_checks == 1  # the scrape after the first pays no bcrypt

    for _ in range(2):
        assert not checker.check("prometheus", "wrong")
    assert checker.bcrypt_checks == 3  # a failure is never cached
    assert not checker.check("mallory", PASSWORD)
    assert not checker.check("grafana", PASSWORD)  # another user's password
    assert checker.bcrypt_checks == 5  # the unknown user cost a (decoy) bcrypt too

    assert checker.check("grafana", "other")  # evicts prometheus from the 1-entry cache
    assert checker.check("prometheus", PASSWORD)
    assert checker.bcrypt_checks == 7

    # bcrypt reads 72 bytes: a longer password is refused, never truncated into a match.
    long_password = "x" * 72
    long_hash = bcrypt.hashpw(long_password.encode(), bcrypt.gensalt(rounds=4)).decode()
    long_checker = BasicAuthChecker({"u": long_hash})
    assert long_checker.check("u", long_password)
    assert not long_checker.check("u", long_password + "anything")
    assert not long_checker.check("u\udcff", "x")  # a lone surrogate: no error, no access


def test_a_flood_of_wrong_passwords_never_queues_good_scrapes(tmp_path: Path) -> None:
    """16 clients send wrong passwords (bcrypt cost 10, as `htpasswd -B` makes) while
    Prometheus scrapes with its good, cached credentials: before, the scrapes waited behind
    the bcrypt checks on the 4 workers (4 ms became about 1 s)."""
    password = "the-real-one"
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=10)).decode()
    config = WebConfig(source=tmp_path / "web.yml", users={"prometheus": hashed})
    with serving(config) as server:
        good = basic("prometheus", password)
        assert get(server.port, context=None, headers=good).status == 200  # now cached
        stop = threading.Event()
        codes: list[int] = []

        def flood(n: int) -> None:
            while not stop.is_set():
                codes.append(get(server.port, context=None, headers=basic("x", f"w{n}")).status)

        flooders = [threading.Thread(target=flood, args=(n,)) for n in range(16)]
        for thread in flooders:
            thread.start()
        try:
            time.sleep(0.5)  # the flood is on
            took = []
            for _ in range(20):
                start = time.monotonic()
                answer = get(server.port, context=None, headers=good)
                took.append(time.monotonic() - start)
                assert answer.status == 200 and b"probe_value" in answer.body
        finally:
            stop.set()
            for thread in flooders:
                thread.join(15)
    # One bcrypt check at a time (about 50 ms at cost 10) and the others refused at once: a
    # good scrape never waits for the checks queued before it.
    assert max(took) < 0.5, took
    assert 429 in codes and 401 in codes and set(codes) <= {401, 429}


def test_the_cache_holds_no_password() -> None:
    checker = BasicAuthChecker({"prometheus": HASH})
    assert checker.check("prometheus", PASSWORD)
    keys = list(checker._cache)
    assert len(keys) == 1 and len(keys[0]) == 32
    assert PASSWORD.encode() not in keys[0]


# --- the example ------------------------------------------------------------------------------


def test_the_example_passes_promtool_and_our_checks(certs: Certs, tmp_path: Path) -> None:
    if PROMTOOL is None:
        pytest.fail("promtool is missing: `make test` installs Debian's prometheus package")
    text = EXAMPLE.read_text()
    assert "/etc/gpu-fleet/exporter.crt" in text and "/etc/gpu-fleet/exporter.key" in text
    # promtool loads the certificate pair the file names, so point a copy at generated ones.
    pair = install(certs.server, tmp_path)
    copy = tmp_path / "web-config.yml"
    copy.write_text(
        text.replace("/etc/gpu-fleet/exporter.crt", str(pair.cert)).replace(
            "/etc/gpu-fleet/exporter.key", str(pair.key)
        )
    )
    result = subprocess.run(
        [PROMTOOL, "check", "web-config", str(copy)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    config = load_web_config(copy)
    assert config.tls is not None and config.notes == ()
    # The documented example password is the one the hash was made from.
    assert bcrypt.checkpw(EXAMPLE_PASSWORD.encode(), config.users["prometheus"].encode())


def test_tls_handshake_and_what_follows_are_under_the_deadline(
    certs: Certs, tmp_path: Path
) -> None:
    pair = install(certs.server, tmp_path / "tls")
    config = load_web_config(write_config(tmp_path / "web.yml", tls_config(pair)))
    with serving(config, read_timeout_seconds=1.5) as server:
        # Connected, never a ClientHello: closed at the deadline.
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        # Half a ClientHello (a TLS record header promising more): likewise.
        half = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        half.sendall(bytes([0x16, 0x03, 0x01, 0x02, 0x00]) + b"\x01")
        # A finished handshake and no request: the socket did not go back to blocking
        # without a timeout; it is closed at the same deadline.
        done = client_context(certs.ca).wrap_socket(
            socket.create_connection(("127.0.0.1", server.port), timeout=5),
            server_hostname="localhost",
        )
        started = time.monotonic()
        for sock in (silent, half, done):
            sock.settimeout(5)
            # A reset or a TLS alert instead of a clean EOF: closed all the same.
            with contextlib.suppress(ConnectionResetError, ssl.SSLError):
                assert sock.recv(100) == b""
        assert time.monotonic() - started < 4
        for sock in (silent, half, done):
            sock.close()
        # The server still answers.
        assert get(server.port, context=client_context(certs.ca)).status == 200
