"""The remediator's HTTP front against hostile clients, as a real `serve` process.

A huge unauthenticated body is refused from its Content-Length before much of it is read; idle
and half-open connections do not lock out the webhook or `/healthz`; every answer is counted;
with the example web config (certificates made by the openssl CLI, as the exporter's TLS tests
make them) the listener speaks TLS, adds its headers and guards /metrics with its users.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from tests.llama_lab import free_port
from tests.remediator_lab import ALERTMANAGER_FIXTURES, write_setup
from tests.test_remediator_process import Replica
from tests.test_webconfig import HASH, PASSWORD, Certs, certs

MIB = 1024 * 1024
REPO = Path(__file__).resolve().parent.parent
# The bcrypt hash in examples/web-config.yml (of its example password).
EXAMPLE_HASH = "$2b$10$U/1MUMcRx.Bt5ARWPgzg6.HZGL4Dy4Qf4zJMk9fiP4fmEvLhj71PK"
__all__ = ["certs"]  # the module-scoped fixture, shared with the exporter's TLS tests


def _replica(tmp_path: Path) -> Replica:
    port = free_port()
    setup = write_setup(tmp_path, servers={"alpha": "http://127.0.0.1:9"},
                        listen=f"127.0.0.1:{port}")  # fmt: skip
    return Replica(setup, port, tmp_path / "remediator.log").start()


def test_a_200_mib_unauthenticated_body_is_refused_before_20_mib_are_read(
    tmp_path: Path,
) -> None:
    replica = _replica(tmp_path)
    try:
        sock = socket.create_connection(("127.0.0.1", replica.port), timeout=10)
        sock.sendall(
            b"POST /webhook/alertmanager HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n" + f"Content-Length: {200 * MIB}\r\n\r\n".encode()
        )
        sent = 0
        chunk = b"x" * (256 * 1024)
        sock.settimeout(5)
        try:
            while sent < 200 * MIB:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the server closed: good
        answer = b""
        try:
            while b"\r\n\r\n" not in answer:
                part = sock.recv(65536)
                if not part:
                    break
                answer += part
        except OSError:
            pass
        sock.close()
        assert sent < 20 * MIB, f"{sent / MIB:.0f} MiB were taken before the refusal"
        assert answer.startswith(b"HTTP/1.1 413") or answer == b"", answer[:200]
        assert replica.request("GET", "/api/runs", admin=True)["runs"] == []
    finally:
        replica.stop()


def test_150_idle_connections_leave_the_webhook_and_healthz_answering(tmp_path: Path) -> None:
    replica = _replica(tmp_path)
    idle: list[socket.socket] = []
    try:
        for _ in range(150):
            idle.append(socket.create_connection(("127.0.0.1", replica.port), timeout=5))
        for half in idle[::2]:  # half-open: a request head begun, never ended
            half.sendall(b"POST /webhook/alertmanager HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.5)
        started = time.monotonic()
        assert replica._healthy()
        body = json.loads((ALERTMANAGER_FIXTURES / "firing.json").read_text())
        assert replica.request("POST", "/webhook/alertmanager", body)["status"] == "ok"
        assert time.monotonic() - started < 5
        metrics = _get(replica.port, "/metrics")
        assert 'gpufleet_remediator_http_responses_total{code="200",handler="webhook"} 1.0' in (
            metrics
        )
        assert 'handler="healthz"' in metrics
    finally:
        for sock in idle:
            sock.close()
        replica.stop()


def _get(port: int, path: str) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        data = b""
        while part := sock.recv(65536):
            data += part
    return data.decode(errors="replace")


def test_tls_from_the_example_web_config(tmp_path: Path, certs: Certs) -> None:
    import base64
    import http.client
    import ssl
    import subprocess

    from tests.llama_lab import stop_process, wait_until
    from tests.test_remediator_process import REMEDIATOR

    # The example file as shipped, its paths and hash swapped for the test's own.
    example = (REPO / "examples" / "web-config.yml").read_text()
    web = tmp_path / "web-config.yml"
    web.write_text(
        example.replace("/etc/gpu-fleet/exporter.crt", str(certs.server.cert))
        .replace("/etc/gpu-fleet/exporter.key", str(certs.server.key))
        .replace(EXAMPLE_HASH, HASH)
    )
    port = free_port()
    setup = write_setup(tmp_path, servers={"alpha": "http://127.0.0.1:9"},
                        listen=f"127.0.0.1:{port}", extra=f"web_config_file: {web}\n")  # fmt: skip
    context = ssl.create_default_context(cafile=str(certs.ca))

    def request(
        method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            answer = conn.getresponse()
            return answer.status, dict(answer.getheaders()), answer.read()
        finally:
            conn.close()  # fmt: skip

    log = (tmp_path / "remediator.log").open("wb")
    proc = subprocess.Popen([REMEDIATOR, "serve", "--config", str(setup.config)],
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    def up() -> bool:
        assert proc.poll() is None, (tmp_path / "remediator.log").read_text()
        try:
            return request("GET", "/healthz")[0] == 200
        except OSError:
            return False

    try:
        wait_until(up, timeout=30, what="the remediator on TLS")
        status, headers, _ = request("GET", "/healthz")
        assert status == 200 and headers.get("X-Content-Type-Options") == "nosniff"
        body = (ALERTMANAGER_FIXTURES / "firing.json").read_bytes()
        bearer = {"Authorization": f"Bearer {setup.webhook_token}",
                  "Content-Type": "application/json"}  # fmt: skip
        status, _, answer = request("POST", "/webhook/alertmanager", body, bearer)
        assert status == 200 and json.loads(answer)["runs"] == [1]
        assert request("GET", "/metrics")[0] == 401  # the web config's users guard /metrics
        scrape = {"Authorization": "Basic " + base64.b64encode(
            f"prometheus:{PASSWORD}".encode()).decode()}  # fmt: skip
        status, _, metrics = request("GET", "/metrics", headers=scrape)
        assert status == 200 and b"gpufleet_remediator_webhook_requests_total" in metrics
        plain = _get(port, "/healthz")  # plain HTTP on the TLS port
        assert plain.startswith("HTTP/1.0 400") and "HTTPS server" in plain
    finally:
        stop_process(proc, 15)
        log.close()


def test_healthz_and_the_webhook_are_honest_while_postgresql_is_cut(tmp_path: Path) -> None:
    """The journal's PostgreSQL goes away (through a proxy the test cuts; the machine's own
    server is never touched): /healthz says 503, the webhook answers 503 (Alertmanager retries),
    and both recover once it is back — nothing answered 200 was lost."""
    from tests.pg import throwaway_database
    from tests.tcp_proxy import TcpProxy

    with throwaway_database() as url, TcpProxy(5432) as proxy:
        proxied = url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        port = free_port()
        setup = write_setup(tmp_path, servers={"alpha": "http://127.0.0.1:9"},
                            listen=f"127.0.0.1:{port}", journal_url=proxied)  # fmt: skip
        replica = Replica(setup, port, tmp_path / "remediator.log").start()
        try:
            body = json.loads((ALERTMANAGER_FIXTURES / "firing.json").read_text())
            assert replica.request("POST", "/webhook/alertmanager", body)["status"] == "ok"
            proxy.cut()
            health = _get(port, "/healthz")
            assert health.startswith("HTTP/1.1 503") or health.startswith("HTTP/1.0 503"), health
            assert "journal cannot write" in health
            other = json.loads(json.dumps(body).replace("5f2a9c0e1b3d4a67", "0000000000000001"))
            status = _post_status(port, setup.webhook_token, json.dumps(other).encode())
            assert status == 503  # retried by Alertmanager, never a silent 200
            proxy.restore()
            deadline = time.monotonic() + 30
            while not replica._healthy() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert replica._healthy()
            assert replica.request("POST", "/webhook/alertmanager", other)["status"] == "ok"
            fingerprints = {r["alert"]["fingerprint"] for r in replica.runs()}
            assert fingerprints == {"5f2a9c0e1b3d4a67", "0000000000000001"}
        finally:
            replica.stop()


def _post_status(port: int, token: str, body: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            b"POST /webhook/alertmanager HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {token}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = sock.recv(64)
    return int(head.split(b" ")[1])
