"""The remediator's HTTP front against hostile clients, as a real `serve` process.

A huge unauthenticated body is refused from its Content-Length before much of it is read; idle
and half-open connections do not lock out the webhook or `/healthz`; every answer is counted.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from tests.llama_lab import free_port
from tests.remediator_lab import ALERTMANAGER_FIXTURES, write_setup
from tests.test_remediator_process import Replica

MIB = 1024 * 1024


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
