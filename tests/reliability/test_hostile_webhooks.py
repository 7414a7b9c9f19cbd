"""Reliability 1: hostile webhooks, through the real app and against a real `serve` process.

- Hostile bodies (`strategies.bodies`, a few thousand at full size) through `create_app`'s
  WSGI stack on a real SQLite journal, the engine's workers running: every answer is 200 and
  journaled, or a 4xx and not journaled; never a 5xx; no action for a target outside the
  roster; no loop dead; a good alert posted afterwards runs to its end.
- Replayed and reordered notifications (HA twins, repeats, resolutions before their firing,
  shuffled): never two actions for one occurrence, and an occurrence that never resolved runs
  exactly once.
- Wrong and missing credentials: 401, nothing journaled.
- A slow-loris (hundreds of connections sending their request head a byte at a time) and
  large bodies (over the limit with and without Content-Length, and lying about it) against
  a real `gpu-fleet-remediator serve`, while real alerts keep arriving: every real alert is
  answered 200 and journaled, `/healthz` answers throughout.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remediator.config import load_config
from remediator.service import Services, build_services
from remediator.web import create_app
from tests.llama_lab import free_port, wait_until
from tests.reliability.figures import Figures, sized
from tests.reliability.harness import (
    CountingServers,
    dumps,
    journal_query,
    journaled_group_keys,
    notification,
    post,
)
from tests.reliability.strategies import HOSTILE, bodies
from tests.remediator_lab import Setup, write_setup
from tests.test_remediator_process import Replica

pytestmark = pytest.mark.reliability

SUITE = "1 webhooks"
ALLOWED = {200, 400, 413}
_HYPOTHESIS: dict[str, Any] = {
    "derandomize": True,
    "deadline": None,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


@dataclass
class WebhookLab:
    """The real app on a real SQLite journal; every roster server one of `model`'s listeners."""

    client: FlaskClient
    services: Services
    setup: Setup
    model: CountingServers
    journal: Path
    servers: dict[str, str]

    def post(self, body: bytes, authorization: str | None = "default") -> int:
        headers = {}
        if authorization == "default":
            headers["Authorization"] = f"Bearer {self.setup.webhook_token}"
        elif authorization is not None:
            headers["Authorization"] = authorization
        answer = self.client.post(
            "/webhook/alertmanager", data=body, headers=headers, content_type="application/json"
        )
        return int(answer.status_code)

    def admitted(self) -> int:
        rows = journal_query(
            self.journal, "SELECT count(*) FROM notifications WHERE rejected IS NULL"
        )
        return int(rows[0][0])

    def runs(self) -> list[dict[str, Any]]:
        rows = journal_query(
            self.journal,
            "SELECT r.id, r.state, r.decision, r.target, r.outcome, a.fingerprint, a.starts_at "
            "FROM runs r JOIN alerts a ON a.id = r.alert_id ORDER BY r.id",
        )
        keys = ("id", "state", "decision", "target", "outcome", "fingerprint", "starts_at")
        return [dict(zip(keys, row, strict=True)) for row in rows]

    def wrong_actions(self) -> list[str]:
        """Runs that acted on a target outside the roster, and restarts no run decided."""
        roster = self.services.roster
        wrong = []
        acting: Counter[str] = Counter()
        for run in self.runs():
            if run["target"] is None or run["decision"] != "run":
                continue
            acting[str(run["target"])] += 1
            kind, host, *rest = str(run["target"]).split("/")
            if host not in roster.hosts or (
                kind == "server" and (not rest or rest[0] not in roster.hosts[host].servers)
            ):
                wrong.append(f"run {run['id']} on {run['target']}")
        with self.model._lock:
            hits = dict(self.model.hits)
        for (server, path), count in hits.items():
            if path == "/restart" and count > acting[f"server/dioscuri/{server}"]:
                runs = acting[f"server/dioscuri/{server}"]
                wrong.append(f"{count} restarts of {server}, {runs} runs decided")
        return wrong


def make_lab(tmp_path: Path, count: int, **options: Any) -> Iterator[WebhookLab]:
    model = CountingServers(["alpha", "beta", *(f"s{i}" for i in range(count))])
    servers = model.urls()
    setup = write_setup(
        tmp_path, servers=servers, extra="limits: {max_runs_per_hour: 100000}\n", **options
    )
    config = load_config(setup.config)
    services = build_services(config)
    app = create_app(config, services)
    try:
        yield WebhookLab(
            app.test_client(), services, setup, model, tmp_path / "journal.db", servers
        )
    finally:
        services.close()
        model.close()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[WebhookLab]:
    for made in make_lab(tmp_path, 120):  # the config allows 200 restart URLs
        made.services.start()  # the workers and the heartbeat run, as under `serve`
        yield made


def _wait_all_done(lab: WebhookLab, *, waiting_too: bool = False, timeout: float = 60.0) -> None:
    def done() -> bool:
        # A run waiting out a cooldown (repeats on alpha) is decided: pending with a reason,
        # not lost. Otherwise every run must end.
        ended = ("done", "pending") if waiting_too else ("done",)
        return all(r["state"] in ended for r in lab.runs())

    wait_until(done, timeout=timeout, what="every claimed run to end")


def _good_alert_runs(lab: WebhookLab, server: str) -> None:
    fingerprint = "900d" + f"{int(server[1:]):012x}"
    assert lab.post(dumps(notification(server, fingerprint, group_key=f"good-{server}"))) == 200
    wait_until(
        lambda: any(r["fingerprint"] == fingerprint and r["state"] == "done" for r in lab.runs()),
        timeout=30,
        what="the good alert's run",
    )
    [run] = [r for r in lab.runs() if r["fingerprint"] == fingerprint]
    assert run["outcome"] == "healed", run
    assert lab.model.count(server, "/restart") == 1


def test_hostile_bodies_are_answered_4xx_or_200_and_journaled(
    lab: WebhookLab, figures: Figures
) -> None:
    seen: dict[int, int] = {}
    lost: list[bytes] = []
    phantom: list[bytes] = []

    @settings(max_examples=sized(400, 3000), **_HYPOTHESIS)
    @given(body=bodies())
    def post(body: bytes) -> None:
        before = lab.admitted()
        status = lab.post(body)
        seen[status] = seen.get(status, 0) + 1
        after = lab.admitted()
        if status == 200 and after != before + 1:
            lost.append(body[:300])
        if status != 200 and after != before:
            phantom.append(body[:300])
        assert status in ALLOWED, (status, body[:300])

    try:
        post()
    finally:
        figures.add(SUITE, "hostile bodies posted", sum(seen.values()))
        figures.add(SUITE, "answered 200 (admitted)", seen.get(200, 0))
        figures.add(SUITE, "answered 4xx", sum(n for s, n in seen.items() if 400 <= s < 500))
        figures.zero(
            SUITE, "answered 5xx or other", sum(n for s, n in seen.items() if s not in ALLOWED)
        )
        figures.zero(SUITE, "lost: 200 but not journaled", len(lost))
        figures.zero(SUITE, "4xx but journaled", len(phantom))
    assert lost == [] and phantom == []
    assert seen.get(400, 0) > 50 and seen.get(200, 0) > 10, seen  # both paths were taken
    _wait_all_done(lab, waiting_too=True)
    wrong = lab.wrong_actions()
    dead = lab.services.dead_loops()
    figures.zero(SUITE, "wrong actions (outside the roster)", len(wrong))
    figures.zero(SUITE, "loops dead", len(dead))
    assert wrong == [] and dead == []
    assert lab.client.get("/healthz").status_code == 200
    _good_alert_runs(lab, "s0")
    figures.add(SUITE, "good alert afterwards ran", 1)


# -- replayed and reordered --------------------------------------------------------------------

_COPY = st.sampled_from(["firing", "firing", "earlier twin", "later twin", "resolved"])


@st.composite
def _stories(draw: st.DrawFn) -> list[tuple[int, str]]:
    """What Alertmanager sends about 1-4 occurrences: copies, twins, resolutions, shuffled."""
    occurrences = draw(st.integers(1, 4))
    events = [
        (i, kind)
        for i in range(occurrences)
        for kind in draw(st.lists(_COPY, min_size=1, max_size=6))
    ]
    return draw(st.permutations(events))


def test_replayed_and_reordered_notifications_act_once_per_occurrence(
    tmp_path: Path, figures: Figures
) -> None:
    duplicates: list[str] = []
    lost: list[str] = []
    dead: list[str] = []
    posted = [0]
    labs = iter(range(1_000_000))

    @settings(max_examples=sized(20, 150), **_HYPOTHESIS)
    @given(story=_stories())
    def replay(story: list[tuple[int, str]]) -> None:
        # A journal of its own per story: each occurrence on a server of its own, fresh.
        directory = tmp_path / f"story-{next(labs)}"
        directory.mkdir()
        for lab in make_lab(directory, 4):
            lab.services.start()
            _replay(lab, story)
            dead.extend(lab.services.dead_loops())

    def _replay(lab: WebhookLab, story: list[tuple[int, str]]) -> None:
        for index, kind in story:
            # Twins: an HA Prometheus pair stamps startsAt up to an evaluation apart.
            starts = {
                "earlier twin": "2026-11-30T06:59:45Z",
                "later twin": "2026-11-30T07:00:15Z",
            }.get(kind, "2026-11-30T07:00:00Z")
            body = notification(
                f"s{index}",
                f"{index:016x}",
                starts=starts,
                status="resolved" if kind == "resolved" else "firing",
                ends="2026-11-30T07:05:00Z" if kind == "resolved" else "0001-01-01T00:00:00Z",
                group_key=f"s{index}-{kind}",
            )
            assert lab.post(dumps(body)) == 200
            posted[0] += 1
        _wait_all_done(lab)
        for index in {index for index, _ in story}:
            restarts = lab.model.count(f"s{index}", "/restart")
            kinds = [kind for i, kind in story if i == index]
            if restarts > 1:
                duplicates.append(f"s{index}: {restarts} restarts ({kinds})")
            if "resolved" not in kinds and restarts != 1:
                lost.append(f"s{index}: never resolved, {restarts} restarts ({kinds})")

    try:
        replay()
    finally:
        figures.add(SUITE, "replayed/reordered notifications posted", posted[0])
        figures.zero(SUITE, "duplicate actions (replays)", len(duplicates))
        figures.zero(SUITE, "lost occurrences (replays)", len(lost))
    assert duplicates == [] and lost == [] and dead == []


# -- credentials -------------------------------------------------------------------------------


def test_wrong_and_missing_credentials_are_401_and_journal_nothing(
    lab: WebhookLab, figures: Figures
) -> None:
    token = lab.setup.webhook_token
    fixed = [
        None,
        "",
        "Bearer",
        "Bearer ",
        f"bearer {token}x",
        f"Bearer {token[:-1]}",
        f"Bearer {lab.setup.admin_token}",  # the admin secret never opens the webhook
        f"Basic {token}",
        f"Bearer {token}\x00",
        "Bearer " + "x" * 10_000,
    ]
    answers: dict[int, int] = {}
    admitted = lab.admitted()
    body = dumps(notification("s1", "cred000000000000", group_key="credentials"))

    def check(authorization: str | None) -> None:
        status = lab.post(body, authorization=authorization)
        answers[status] = answers.get(status, 0) + 1
        assert status == 401, (authorization, status)

    for authorization in fixed:
        check(authorization)

    @settings(max_examples=sized(100, 500), **_HYPOTHESIS)
    @given(value=st.one_of(HOSTILE, st.text(max_size=80).map(lambda t: f"Bearer {t}")))
    def fuzz(value: str) -> None:
        scheme, _, rest = value.strip().partition(" ")
        if scheme.lower() == "bearer" and rest.strip() == token:
            return  # the credential itself (RFC 6750: any case, spaces around it)
        try:
            value.encode("latin-1")
        except UnicodeEncodeError:
            return  # not sendable as an HTTP header at all
        if "\n" in value or "\r" in value:
            return  # a header line cannot hold one (a client refuses to send it)
        check(value)

    try:
        fuzz()
    finally:
        figures.add(SUITE, "bad credentials tried", sum(answers.values()))
        journaled = lab.admitted() - admitted
        figures.zero(SUITE, "journaled without credentials", journaled)
        figures.zero(
            SUITE,
            "bad credentials not answered 401",
            sum(n for s, n in answers.items() if s != 401),
        )
    assert journaled == 0
    assert lab.model.count("s1", "/health") == 0


# -- slow-loris and large bodies against `serve` -----------------------------------------------


class _SlowLoris:
    """Connections that send a request head one byte at a time, round-robin, never ending it."""

    def __init__(self, port: int, count: int) -> None:
        head = (
            b"POST /webhook/alertmanager HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n" + b"X-Pad: " + b"a" * 4000
        )
        self.head = head
        self.sockets: list[tuple[socket.socket, int]] = []
        for _ in range(count):
            self.sockets.append((socket.create_connection(("127.0.0.1", port), timeout=5), 0))
        self.closed_by_server = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            alive = []
            for sock, sent in self.sockets:
                try:
                    sock.send(self.head[sent % len(self.head) :][:1])
                    alive.append((sock, sent + 1))
                except OSError:
                    self.closed_by_server += 1
                    sock.close()
            self.sockets = alive
            self._stop.wait(0.5)  # one byte per connection every half second

    def __enter__(self) -> _SlowLoris:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for sock, _ in self.sockets:
            sock.close()


def _large_body(port: int, token: str, how: str) -> bytes:
    """One large-body attack; the first bytes of the answer (b"" when the server hung up)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (
        b"POST /webhook/alertmanager HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {token}\r\n".encode()
    )
    chunk = b"[" * 65536
    try:
        if how == "content-length":
            sock.sendall(head + f"Content-Length: {4 * 1024 * 1024}\r\n\r\n".encode())
            for _ in range(64):
                sock.sendall(chunk)
        elif how == "chunked":
            sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
            for _ in range(64):
                sock.sendall(b"10000\r\n" + chunk + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        else:  # "lying": says 100 bytes, sends 4 MiB of nested JSON after them
            sock.sendall(head + b"Content-Length: 100\r\n\r\n")
            for _ in range(64):
                sock.sendall(chunk)
    except OSError:
        pass  # the server closed on us: refused early, good
    answer = b""
    with contextlib.suppress(OSError):
        answer = sock.recv(64)
    sock.close()
    return answer


def test_slow_loris_and_large_bodies_while_real_alerts_are_admitted(
    tmp_path: Path, figures: Figures
) -> None:
    model = CountingServers([f"s{i}" for i in range(8)])
    port = free_port()
    setup = write_setup(
        tmp_path,
        servers=model.urls(),
        listen=f"127.0.0.1:{port}",
        extra="limits: {max_runs_per_hour: 100000}\n",
    )
    replica = Replica(setup, port, tmp_path / "remediator.log").start()
    journal = tmp_path / "journal.db"
    seconds = sized(15, 120)
    answered: dict[str, int] = {}
    slowest = [0.0]
    attacks: dict[str, int] = {}
    healthz_failures = [0]
    try:
        with _SlowLoris(port, sized(300, 800)) as loris:
            stop = time.monotonic() + seconds
            rng = random.Random(17)
            index = 0
            while time.monotonic() < stop:
                group = f"real-{index}"
                body = notification(
                    f"s{index % 8}",
                    f"{index:016x}",
                    group_key=group,
                    starts=f"2026-11-30T07:{index // 60 % 60:02d}:{index % 60:02d}Z",
                )
                started = time.monotonic()
                status = post(port, setup.webhook_token, dumps(body), timeout=30)
                slowest[0] = max(slowest[0], time.monotonic() - started)
                answered[group] = status
                index += 1
                how = rng.choice(["content-length", "chunked", "lying"])
                answer = _large_body(port, setup.webhook_token, how)
                kind = f"{how}: {answer[:12].decode(errors='replace') or 'closed'}"
                attacks[kind] = attacks.get(kind, 0) + 1
                if not replica._healthy():
                    healthz_failures[0] += 1
            still_open = len(loris.sockets)
        journaled = journaled_group_keys(journal)
        not_200 = {g: s for g, s in answered.items() if s != 200}
        lost = [g for g, s in answered.items() if s == 200 and g not in journaled]
        smuggled = [g for g in journaled if not g.startswith("real-")]
    finally:
        replica.stop()
        model.close()
    figures.add(SUITE, "slow-loris connections held", still_open)
    figures.add(SUITE, "large-body attacks", sum(attacks.values()))
    figures.add(SUITE, "real alerts during the attacks", len(answered))
    figures.add(SUITE, "slowest real alert answer (ms)", int(slowest[0] * 1000))
    figures.zero(SUITE, "real alerts not answered 200", len(not_200))
    figures.zero(SUITE, "real alerts lost (200, not journaled)", len(lost))
    figures.zero(SUITE, "attack bodies journaled", len(smuggled))
    figures.zero(SUITE, "/healthz failures during the attacks", healthz_failures[0])
    print(f"large-body answers: {json.dumps(attacks, sort_keys=True)}")
    assert not_200 == {} and lost == [] and smuggled == [] and healthz_failures[0] == 0
    assert len(answered) >= 10, "too few real alerts got through to judge"
    assert all(
        kind.split(": ")[1] in ("HTTP/1.1 413", "HTTP/1.1 400", "closed") for kind in attacks
    ), attacks
